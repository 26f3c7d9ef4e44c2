"""The disk KV cache's files, without torch: where the blocks are (one directory scan, least
recently used first), the persistent counts, and what `localrun cache` shows and clears. The
cache itself (reading and writing blocks) is localrun/engine/disk_cache.py."""
from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

SUFFIX = ".safetensors"
STATS_FILE = "stats.json"
STALE_TMP_S = 3600                      # a temp file this old was left by a crashed writer


@dataclass
class _Index:
    """Every block file under root, least recently used first, with its size."""
    files: OrderedDict[Path, int] = field(default_factory=OrderedDict)
    num_bytes: int = 0

    def add(self, path: Path, size: int) -> None:
        self.num_bytes += size - self.files.pop(path, 0)
        self.files[path] = size

    def remove(self, path: Path) -> None:
        self.num_bytes -= self.files.pop(path, 0)


def scan(root: Path) -> _Index:
    """Index the block files under root by mtime; delete temp files left by crashed writers."""
    entries, now = [], time.time()
    for ns_dir in (root.iterdir() if root.is_dir() else ()):
        if not ns_dir.is_dir():
            continue
        for entry in os.scandir(ns_dir):
            try:
                st = entry.stat()
            except OSError:
                continue
            if entry.name.endswith(SUFFIX):
                entries.append((st.st_mtime, Path(entry.path), st.st_size))
            elif entry.name.endswith(".tmp") and now - st.st_mtime > STALE_TMP_S:
                Path(entry.path).unlink(missing_ok=True)
    index = _Index()
    for _, path, size in sorted(entries):
        index.add(path, size)
    return index


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def load_stats(root: Path) -> dict[str, int | float]:
    """The counts every process added to root's stats file ({} if none or unreadable)."""
    try:
        data = json.loads((Path(root) / STATS_FILE).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def summarize(root: Path) -> dict:
    """What `localrun cache` shows: files and bytes per namespace (model and layout), totals,
    and the persistent counts."""
    root = Path(root)
    index = scan(root)
    per_ns: dict[str, dict[str, int]] = {}
    for path, size in index.files.items():
        entry = per_ns.setdefault(path.parent.name, {"files": 0, "bytes": 0})
        entry["files"] += 1
        entry["bytes"] += size
    return {"cache_dir": str(root), "files": len(index.files), "bytes": index.num_bytes,
            "namespaces": per_ns, "stats": load_stats(root)}


def clear(root: Path) -> tuple[int, int]:
    """Delete every block file, temp file and the stats file under root; (files, bytes) removed."""
    root = Path(root)
    num_files = num_bytes = 0
    if not root.is_dir():
        return 0, 0
    for ns_dir in root.iterdir():
        if ns_dir.is_dir():
            for entry in os.scandir(ns_dir):
                if entry.name.endswith(SUFFIX) or entry.name.endswith(".tmp"):
                    try:
                        size = entry.stat().st_size
                        os.unlink(entry.path)
                    except OSError:
                        continue
                    if entry.name.endswith(SUFFIX):
                        num_files, num_bytes = num_files + 1, num_bytes + size
            try:
                ns_dir.rmdir()
            except OSError:
                pass
    (root / STATS_FILE).unlink(missing_ok=True)
    return num_files, num_bytes
