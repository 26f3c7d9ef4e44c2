"""The disk KV cache's files, without torch: where the blocks are (one directory scan, least
recently used first), the persistent counts, and what `localrun cache` shows and clears. The
cache itself (reading and writing blocks) is localrun/engine/disk_cache.py.

The stats file is read as untrusted input (another program, a bad edit or a torn disk may
have written it): anything but a small JSON object of DiskCacheStats' counts, each a
non-negative number of the field's kind, is ignored as a whole with one sentence saying
why; its counts then start again from zero and the next save rewrites it cleanly."""
from __future__ import annotations

import json
import math
import os
import stat
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from pathlib import Path

SUFFIX = ".safetensors"
STATS_FILE = "stats.json"
STALE_TMP_S = 3600                      # a temp file this old was left by a crashed writer
MAX_STATS_BYTES = 64 * 1024             # what this code writes is ~300 bytes
MAX_COUNT = 2 ** 63                     # a count past this was not written by a process of ours


@dataclass
class DiskCacheStats:
    num_loaded_blocks: int = 0      # blocks copied from disk into the pool
    num_loaded_bytes: int = 0
    num_written_blocks: int = 0
    num_written_bytes: int = 0
    num_write_drops: int = 0        # not written: the queue was full
    window_s: float = 0.0           # time the busy engine gave the writer between steps (write_window)
    num_corrupt: int = 0            # files found unusable and deleted
    num_evicted_files: int = 0      # deleted to keep the size bound
    load_s: float = 0.0             # time spent loading (on the request's path)

    def as_dict(self) -> dict[str, int | float]:
        return dict(self.__dict__)


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
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)       # e.g. path is a directory, or the disk is full
        raise


def read_stats(root: Path) -> tuple[dict[str, int | float], str | None]:
    """The counts every process added to root's stats file, and, when the file is there but
    not what this code writes, {} and one sentence saying why (no file: {} and None)."""
    path = Path(root) / STATS_FILE
    try:
        raw = read_small_file(path, MAX_STATS_BYTES)
    except FileNotFoundError:
        return {}, None
    except OSError as e:
        return {}, bad_stats(path, e.strerror or str(e))
    if raw is None:
        return {}, bad_stats(path, f"it is not a regular file of at most {MAX_STATS_BYTES:,} bytes")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return {}, bad_stats(path, "it is not valid JSON")
    if not isinstance(data, dict):
        return {}, bad_stats(path, "it is not a JSON object")
    counts: dict[str, int | float] = {}
    for f in fields(DiskCacheStats):
        if f.name not in data:
            continue
        value, is_time = data[f.name], isinstance(f.default, float)
        kinds = (int, float) if is_time else (int,)
        if (isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value)
                or not 0 <= value < MAX_COUNT):
            kind = "a number of seconds" if is_time else "a count"
            return {}, bad_stats(path, f"'{f.name}' is {json.dumps(value)[:40]}, not {kind} >= 0")
        counts[f.name] = value
    return counts, None


def bad_stats(path: Path, why: str) -> str:
    return f"ignoring the KV cache stats file {path} ({why}); its counts start again from zero"


def read_small_file(path: Path, limit: int) -> bytes | None:
    """The bytes of path if it is a regular file of at most limit bytes, else None. Never
    blocks on a FIFO or reads past limit (a link to /dev/zero, a huge file)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
        return data if len(data) <= limit else None
    finally:
        os.close(fd)


def load_stats(root: Path) -> dict[str, int | float]:
    """The counts every process added to root's stats file ({} if none or not to be trusted)."""
    return read_stats(root)[0]


def summarize(root: Path) -> dict:
    """What `localrun cache` shows: files and bytes per namespace (model and layout), totals,
    the persistent counts, and `stats_warning` when the stats file was ignored (read_stats)."""
    root = Path(root)
    index = scan(root)
    per_ns: dict[str, dict[str, int]] = {}
    for path, size in index.files.items():
        entry = per_ns.setdefault(path.parent.name, {"files": 0, "bytes": 0})
        entry["files"] += 1
        entry["bytes"] += size
    counts, problem = read_stats(root)
    summary = {"cache_dir": str(root), "files": len(index.files), "bytes": index.num_bytes,
               "namespaces": per_ns, "stats": counts}
    if problem is not None:
        summary["stats_warning"] = problem
    return summary


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
