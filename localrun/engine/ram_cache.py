"""The host-RAM tier of the prefix cache: copies of full KV blocks in host memory, by chained hash.

When the KV pool is on a GPU, a cached prefix block that the pool evicts is gone from the
device; with this tier its copy stays in host RAM, and a later request with that prefix gets
it copied back (a host-to-device copy of ~0.1-1 MB per block) instead of recomputing it.
It is a KVTier (see block_manager): every block the pool registers is copied here (`store`,
one gather per pool tensor), and `load` writes a copy back into a free pool block before
admission, checked against the block's token ids. Bounded by `max_bytes`, least recently
used first out.

On a CPU-only machine the pool is already host memory, so this tier would only hold a second
copy of the same bytes: by default (`default_ram_bytes`) it is off there, and on when any
layer's KV lives on an accelerator.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from localrun.engine.paged_kv import PagedKVCache

DEFAULT_MAX_BYTES = 4 << 30          # 4 GiB, and never more than a quarter of the available RAM
AVAILABLE_FRACTION = 0.25


def default_ram_bytes(devices: list[torch.device]) -> int:
    """0 (off) when every KV layer is in host memory; else min(4 GiB, 25% of available RAM)."""
    if all(d.type == "cpu" for d in devices):
        return 0
    import psutil
    return min(DEFAULT_MAX_BYTES, int(psutil.virtual_memory().available * AVAILABLE_FRACTION))


@dataclass
class RamCacheStats:
    num_stored_blocks: int = 0
    num_loaded_blocks: int = 0
    num_evicted_blocks: int = 0


class HostKVCache:
    """A KVTier over a bounded, LRU-ordered dict of host copies of pool blocks."""

    name = "ram"

    def __init__(self, kv_cache: PagedKVCache, max_bytes: int):
        self.kv_cache = kv_cache
        self.max_bytes = max_bytes
        self.blocks: OrderedDict[bytes, tuple[tuple[int, ...], dict[str, torch.Tensor]]] = OrderedDict()
        self.num_bytes = 0
        self.block_bytes = sum(torch.Size(shape).numel() * dtype.itemsize
                               for shape, dtype in kv_cache.block_layout().values())
        self.stats = RamCacheStats()

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self.blocks

    def load(self, block_hash: bytes, token_ids: tuple[int, ...], block_id: int) -> bool:
        entry = self.blocks.get(block_hash)
        if entry is None or entry[0] != token_ids:      # absent, or a hash collision
            return False
        self.kv_cache.write_block(block_id, entry[1])
        self.blocks.move_to_end(block_hash)
        self.stats.num_loaded_blocks += 1
        return True

    def store(self, blocks: list[tuple[bytes, tuple[int, ...], int]]) -> None:
        if self.block_bytes > self.max_bytes:
            return
        new = [b for b in blocks if b[0] not in self.blocks]
        if not new:
            return
        copies = self.kv_cache.copy_blocks([block_id for _, _, block_id in new])
        for (block_hash, token_ids, _), tensors in zip(new, copies):
            # own storage per block: a view would keep the whole batch's copy alive
            self.blocks[block_hash] = (token_ids, {name: t.clone() for name, t in tensors.items()})
            self.num_bytes += self.block_bytes
            self.stats.num_stored_blocks += 1
        while self.num_bytes > self.max_bytes:
            self.blocks.popitem(last=False)
            self.num_bytes -= self.block_bytes
            self.stats.num_evicted_blocks += 1

    def set_busy(self, busy: bool) -> None:
        """Nothing deferred: copies are made in store()."""

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)
