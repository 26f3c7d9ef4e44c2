"""The disk tier of the prefix cache: full KV blocks kept across restarts, by chained hash.

One file per block, `<root>/<namespace>/<block hash>.safetensors`, holding the block's K/V
exactly as the pool stores them (quantized values and scales included) and, in the
safetensors metadata, the namespace, the block hash, its token ids and a CRC-32 of the
tensor bytes. The namespace is a hash of everything that decides what a block's K/V are:
the model's fingerprint, the compute signature (dtype, weight format), the KV type, the
block size and the engine's hash seed. A block is therefore only ever found by the same
model with the same layout, and a load checks all of it again before a byte reaches the pool.

Writes never wait on disk and never compete with a step: `store` copies the blocks out of the
pool (one gather per pool tensor, a memory copy) and queues them; a background thread, at the
lowest CPU priority, waits until the engine is idle (no request in flight: `set_busy`), then
serializes each block to a temporary file and renames it into place (atomic on POSIX and
Windows). On a 2-core machine, writing during the prefill that produced the blocks made that
request's TTFT markedly slower (docs/measurements.md); writing between requests costs requests
nothing. A chat turn or a server's pause between requests is ample time (a block takes ms).
Under load that never pauses, the engine opens a write window between its steps instead
(`write_window`): it waits while the writer runs, for the slack the step left below the
inter-token latency target, or without a target a tenth of the step's time, and, while the
queue is more than half full, until at least one block is written (at most 50 ms). Writes
thus take a bounded share of a busy engine's time and never run beside a step's compute
(except the one a window's end interrupts), and blocks are dropped only when they arrive
faster than that (counted in `num_write_drops`). A stalled disk delays each step by at most
its window. `flush` (at close) writes what is queued
whether or not the engine is busy. A torn,
truncated or bit-flipped file fails the checksum or the parse, is reported once as a
warning, deleted, and never loaded.

The store is bounded (`max_bytes`) with LRU eviction over the whole root (all models): file
mtimes order it, so the order survives restarts (a hit touches its file). The in-memory
index is built by one directory scan at start; a block another process wrote later is still
found (a miss checks the file system), but each process enforces the bound on the files it
knows of, so processes sharing a directory can overshoot it until one of them restarts.
Hit and write counts are added to `<root>/stats.json` when the cache is flushed
(read-modify-write: concurrent processes may lose a few counts); a stats file that is not
what this code writes is ignored with a warning and rewritten (disk_files.read_stats).

Reads are on the request's path (the engine loads a waiting request's prefix before admitting
it): one file read, a CRC and a copy into the pool per block, an order of magnitude less than
computing the block (docs/measurements.md).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import warnings
import weakref
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from localrun.cpu_info import lower_thread_priority
from localrun.engine.disk_files import STATS_FILE, SUFFIX, DiskCacheStats, read_stats, scan, write_atomic
from localrun.engine.paged_kv import PagedKVCache

FORMAT = "localrun-kv-block-1"
DEFAULT_MAX_BYTES = 20 << 30            # 20 GiB, and never more than half the free disk space
MUST_WRITE_WAIT_S = 0.05                # a window waits this long at most for one block when the queue is half full
QUEUE_BLOCKS = 256                      # blocks waiting to be written (~190 MB for SmolLM2 f32)
FINGERPRINT_SAMPLES = 16                # 64 KiB samples of the tensor data in a model fingerprint
SAMPLE_BYTES = 1 << 16

log = logging.getLogger(__name__)


def model_fingerprint(path: str | os.PathLike, data_offset: int) -> str:
    """A hash of a GGUF file's header bytes (every metadata key, tensor name, type, shape and
    offset), its size, and 16 samples of 64 KiB spread over its tensor data.

    Why not hash the whole file: that reads every byte at each start (0.1-0.3 s for a 98 MB
    model, tens of seconds for a 30 GB one). Two files with equal headers and sizes are the
    same model except for a re-quantization or fine-tune that keeps every shape, and those
    change the sampled bytes too; reading 1 MiB costs about a millisecond."""
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.blake2b(digest_size=16)
    digest.update(struct.pack("<q", size))
    with open(path, "rb") as f:
        digest.update(f.read(data_offset))
        span = max(size - data_offset - SAMPLE_BYTES, 0)
        for i in range(FINGERPRINT_SAMPLES):
            f.seek(data_offset + span * i // max(FINGERPRINT_SAMPLES - 1, 1))
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def namespace(*parts: object) -> str:
    """The directory name for blocks computed under these conditions."""
    text = "|".join([FORMAT, *map(str, parts)])
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def compute_signature(model) -> str:
    """What besides the weights file decides the K/V values a model computes: its compute
    dtype, how its weights are held (a weight format that changes the arithmetic, e.g.
    int4 matmuls, should show in `model.weight_format` or in the weight tensor's type), and the
    compiled kernels' build and instruction set: a block another build wrote differs from this
    build's in its last bits, and at a near-tie greedy output then depended on what was on disk
    (SmolLM2's first answer token, 0.13 logits apart, came out two ways)."""
    from localrun import kernels
    wqkv = model.layers[0].attention.wqkv
    return (f"{model.dtype}|{getattr(model, 'weight_format', '')}|{type(wqkv).__qualname__}|"
            f"{getattr(wqkv, 'dtype', '')}|{kernels.signature()}")


def default_max_bytes(root: Path) -> int:
    """20 GiB, or half the free space of the disk holding root if that is less."""
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        fs = os.statvfs(probe)
        free = fs.f_bavail * fs.f_frsize
    except (AttributeError, OSError):     # no statvfs (Windows): trust the default
        return DEFAULT_MAX_BYTES
    return min(DEFAULT_MAX_BYTES, free // 2)


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    """CRC-32 over the tensors' bytes in name order (stdlib, ~1 GB/s: catches torn writes and
    flipped bits; the block hash and token ids in the metadata catch misplaced files)."""
    crc = 0
    for name in sorted(tensors):
        crc = zlib.crc32(tensors[name].contiguous().view(torch.uint8).numpy(), crc)
    return f"{crc:08x}"


def read_metadata(raw: bytes) -> dict[str, str]:
    """The `__metadata__` of a serialized safetensors file (8-byte length, then JSON)."""
    (length,) = struct.unpack("<Q", raw[:8])
    if length > len(raw) - 8:
        raise ValueError("header runs past the end of the file")
    return json.loads(raw[8:8 + length]).get("__metadata__") or {}


@dataclass(frozen=True)
class DiskCacheConfig:
    """Where, how much, and which model file (model_fingerprint()) the blocks belong to."""
    root: Path
    model_fingerprint: str
    max_bytes: int | None = None                 # default: default_max_bytes(root)
    queue_blocks: int = QUEUE_BLOCKS


class BlockFiles:
    """The files of one namespace, the LRU index over the whole root, and the writer thread.
    Holds no reference to the KV pool, so the pool is freed with its engine; the thread stops
    (after writing what is queued) when its DiskKVCache is collected or the process exits."""

    def __init__(self, config: DiskCacheConfig, ns: str):
        self.root = Path(config.root)
        self.dir = self.root / ns
        self.namespace = ns
        self.max_bytes = config.max_bytes if config.max_bytes is not None else default_max_bytes(self.root)
        self.stats = DiskCacheStats()
        self._saved_stats = DiskCacheStats()      # what the stats file already counts
        self.lock = threading.Lock()              # guards index and pending
        self.dir.mkdir(parents=True, exist_ok=True)
        self.index = scan(self.root)
        self.pending: set[bytes] = set()          # queued, not yet on disk
        self.queue: queue.Queue = queue.Queue(maxsize=max(config.queue_blocks, 1))
        self.idle = threading.Event()             # set: no request in flight, writing may proceed
        self.idle.set()
        self.wrote = threading.Event()            # set by the writer after each block
        self.in_window = False                    # the engine is busy but waits in write_window
        self._thread = threading.Thread(target=self._write_loop, name="localrun-kv-disk-writer", daemon=True)
        self._thread.start()

    def path(self, block_hash: bytes) -> Path:
        return self.dir / (block_hash.hex() + SUFFIX)

    def _write_loop(self) -> None:
        lower_thread_priority()
        while True:
            item = self.queue.get()
            if item is None:
                self.queue.task_done()
                return
            self.idle.wait()
            block_hash, token_ids, tensors = item
            try:
                self._write(block_hash, token_ids, tensors)
            except Exception as e:   # a full disk or a permission problem must not kill the thread
                log.warning("could not write a KV cache block: %s", e)
            finally:
                with self.lock:
                    self.pending.discard(block_hash)
                self.queue.task_done()
                self.wrote.set()

    def write_window(self, seconds: float, busy: bool = True) -> int:
        """Let the writer run for about `seconds` while the engine, between two steps, waits
        (or until the queue is empty); while the queue is more than half full, until at least
        one block is written (at most MUST_WRITE_WAIT_S). Returns the blocks written."""
        q, start = self.queue, time.perf_counter()
        if not q.unfinished_tasks:
            return 0
        before, must = self.stats.num_written_blocks, q.qsize() * 2 > q.maxsize
        if seconds <= 0 and not must:
            return 0
        soft, hard = start + max(seconds, 0.0), start + max(seconds, MUST_WRITE_WAIT_S if must else 0.0)
        self.in_window = True
        self.idle.set()
        try:
            while q.unfinished_tasks:
                self.wrote.clear()                # before reading the count: a write after it sets it again
                now, written = time.perf_counter(), self.stats.num_written_blocks - before
                if now >= hard or (now >= soft and (written or not must)):
                    break
                self.wrote.wait(min(hard, soft if written or not must else hard) - now)
        finally:
            if busy:
                self.idle.clear()
            self.in_window = False
            self.stats.window_s += time.perf_counter() - start
        return self.stats.num_written_blocks - before

    def _write(self, block_hash: bytes, token_ids: tuple[int, ...], tensors: dict[str, torch.Tensor]) -> None:
        tensors = {name: t.contiguous() for name, t in tensors.items()}
        metadata = {"format": FORMAT, "namespace": self.namespace, "block_hash": block_hash.hex(),
                    "token_ids": json.dumps(list(token_ids)), "checksum": checksum(tensors)}
        data = save_safetensors(tensors, metadata)
        path = self.path(block_hash)
        write_atomic(path, data)
        with self.lock:                           # the engine's thread and the writer may both be here
            self.stats.num_written_blocks += 1
            self.stats.num_written_bytes += len(data)
            self.index.add(path, len(data))
            victims = []
            while self.index.num_bytes > self.max_bytes and self.index.files:
                victim = next(iter(self.index.files))
                self.index.remove(victim)
                victims.append(victim)
        for victim in victims:
            victim.unlink(missing_ok=True)
            self.stats.num_evicted_files += 1

    def flush(self, timeout: float | None = 60.0) -> bool:
        """Wait until every queued block is on disk (or timeout), then add this process's counts
        to the stats file. True if nothing is left queued."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.idle.set()                           # the next step marks the engine busy again
        while self.queue.unfinished_tasks and self._thread.is_alive():
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(0.002)
        self.save_stats()
        return not self.queue.unfinished_tasks

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        self.flush()
        if self._thread.is_alive():
            self.queue.put(None)
            self._thread.join(timeout=5.0)      # no thread left running when the interpreter exits

    def save_stats(self) -> None:
        now = DiskCacheStats(**self.stats.as_dict())
        delta = {k: v - getattr(self._saved_stats, k) for k, v in now.as_dict().items()}
        if not any(delta.values()):
            return
        try:
            totals, problem = read_stats(self.root)
            if problem is not None:           # rewritten below with this process's counts only
                log.warning("%s", problem)
            for k, v in delta.items():
                totals[k] = totals.get(k, 0) + v
            write_atomic(self.root / STATS_FILE, json.dumps(totals, indent=1).encode())
            self._saved_stats = now
        except OSError as e:
            log.warning("could not update the KV cache stats file: %s", e)


class DiskKVCache:
    """A KVTier (see block_manager) over a directory of safetensors block files."""

    name = "disk"

    def __init__(self, config: DiskCacheConfig, ns: str, kv_cache: PagedKVCache):
        self.files = BlockFiles(config, ns)
        self.kv_cache = kv_cache
        self.layout = kv_cache.block_layout()
        self.stats = self.files.stats
        self._finalizer = weakref.finalize(self, self.files.close)   # also runs at exit

    @property
    def namespace(self) -> str:
        return self.files.namespace

    @property
    def max_bytes(self) -> int:
        return self.files.max_bytes

    def path(self, block_hash: bytes) -> Path:
        return self.files.path(block_hash)

    # --- the KVTier interface -------------------------------------------------------------
    def contains(self, block_hash: bytes) -> bool:
        files, path = self.files, self.path(block_hash)
        with files.lock:
            if path in files.index.files:
                return True
        try:                                        # written by another process since the scan
            size = path.stat().st_size
        except OSError:
            return False
        with files.lock:
            files.index.add(path, size)
        return True

    def load(self, block_hash: bytes, token_ids: tuple[int, ...], block_id: int) -> bool:
        start, files, path = time.perf_counter(), self.files, self.path(block_hash)
        try:
            raw = path.read_bytes()
        except OSError:
            with files.lock:
                files.index.remove(path)
            return False
        try:
            tensors = self._check(raw, block_hash, token_ids)
        except Exception as e:       # any parse or check failure: never load it
            self._discard(path, str(e))
            return False
        self.kv_cache.write_block(block_id, tensors)
        try:
            os.utime(path)          # most recently used, also for the next process
        except OSError:
            pass
        with files.lock:
            files.index.add(path, len(raw))
        self.stats.num_loaded_blocks += 1
        self.stats.num_loaded_bytes += len(raw)
        self.stats.load_s += time.perf_counter() - start
        return True

    def store(self, blocks: list[tuple[bytes, tuple[int, ...], int]]) -> None:
        files = self.files
        with files.lock:
            new = [b for b in blocks if b[0] not in files.pending and self.path(b[0]) not in files.index.files]
        if not new:
            return
        copies = self.kv_cache.copy_blocks([block_id for _, _, block_id in new])
        for (block_hash, token_ids, _), tensors in zip(new, copies):
            with files.lock:
                files.pending.add(block_hash)
            try:
                files.queue.put_nowait((block_hash, token_ids, tensors))
            except queue.Full:
                self.stats.num_write_drops += 1
                with files.lock:
                    files.pending.discard(block_hash)

    def write_window(self, seconds: float) -> int:
        return self.files.write_window(seconds)

    def set_busy(self, busy: bool) -> None:
        if busy:
            self.files.idle.clear()
        else:
            self.files.idle.set()

    # --- checks -----------------------------------------------------------------------------
    def _check(self, raw: bytes, block_hash: bytes, token_ids: tuple[int, ...]) -> dict[str, torch.Tensor]:
        meta = read_metadata(raw)
        if meta.get("format") != FORMAT or meta.get("namespace") != self.namespace:
            raise ValueError("written by another format or model")
        if meta.get("block_hash") != block_hash.hex() or json.loads(meta["token_ids"]) != list(token_ids):
            raise ValueError("holds another block")
        tensors = load_safetensors(raw)
        layout = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
        if layout != self.layout:
            raise ValueError("tensor names, shapes or dtypes differ from the KV pool's")
        if checksum(tensors) != meta.get("checksum"):
            raise ValueError("checksum mismatch")
        return tensors

    def _discard(self, path: Path, why: str) -> None:
        warnings.warn(f"Ignoring the corrupt KV cache file {path} ({why}); it was deleted.", stacklevel=3)
        self.stats.num_corrupt += 1
        with self.files.lock:
            self.files.index.remove(path)
        path.unlink(missing_ok=True)

    # --- lifecycle ----------------------------------------------------------------------
    @property
    def num_bytes(self) -> int:
        """Bytes of block files under root (all models), as this process knows them."""
        return self.files.index.num_bytes

    @property
    def num_files(self) -> int:
        return len(self.files.index.files)

    def flush(self, timeout: float | None = 60.0) -> bool:
        """Wait until every queued block is on disk; see BlockFiles.flush."""
        return self.files.flush(timeout)

    def close(self) -> None:
        self._finalizer()

