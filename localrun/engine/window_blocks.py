"""KV blocks of the sliding-window (local) layers: a second pool with a block table per sequence,
holding only the blocks that a query can still reach. Torch-free, like the BlockManager that
drives it.

A local layer's query at position p reads keys p - window + 1 .. p, so once a sequence has
computed C tokens, its local blocks wholly before position C - window + 1 are never read
again and go back to the pool: a sequence holds about n_local x min(L, window) tokens of local
KV (plus the block being filled and the step's new tokens), where the global layers hold
n_global x L. The table keeps one entry per logical block, FREED for those given back.

Prefix caching: a full local block is registered under the same chained hash as the global
block of the same tokens, and a freed registered block stays reusable until evicted (least
recently freed first). A prefix of n blocks found in the global cache is usable only if the
local blocks its next query reads (those from position n*bs - window + 1 on) are cached too;
otherwise the hit is shortened to the longest prefix for which they are, and the rest is
recomputed. Lower tiers (RAM, disk) keep the global layers only, so a prefix they restore is
used as far as the local pool still holds its window.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable

FREED = -1


class WindowBlocks:

    def __init__(self, num_blocks: int, block_size: int, sliding_window: int):
        assert num_blocks > 0 and sliding_window > 0
        self.num_blocks, self.block_size, self.sliding_window = num_blocks, block_size, sliding_window
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.token_ids: list[tuple[int, ...]] = [()] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.evictable_block_ids: OrderedDict[int, None] = OrderedDict()   # registered, ref 0, LRU first
        self.cached_block_ids: dict[bytes, int] = {}
        self.tables: dict[str, list[int]] = {}                            # request id -> local block table

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.evictable_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def first_needed_block(self, position: int) -> int:
        """The first logical block a query at `position` reads."""
        return max(0, position - self.sliding_window + 1) // self.block_size

    def table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def num_held_blocks(self, request_id: str) -> int:
        return sum(1 for b in self.table(request_id) if b != FREED)

    # --- prefix lookup -----------------------------------------------------------------
    def _cached(self, block_hash: bytes, token_ids: tuple[int, ...]) -> int | None:
        block_id = self.cached_block_ids.get(block_hash)
        return block_id if block_id is not None and self.token_ids[block_id] == token_ids else None

    def usable_prefix(self, hashes: list[bytes], token_ids: Callable[[int], tuple[int, ...]]) -> int:
        """The longest n <= len(hashes) whose next query's window (blocks first_needed_block(n*bs)
        .. n-1) is cached."""
        run = 0                               # cached blocks in a row ending at block i
        best = 0
        for i, h in enumerate(hashes):
            run = run + 1 if self._cached(h, token_ids(i)) is not None else 0
            n = i + 1
            if run >= n - self.first_needed_block(n * self.block_size):
                best = n
        return best

    def _window_hits(self, hashes, token_ids, n: int) -> list[int]:
        return [self._cached(hashes[i], token_ids(i)) for i in range(self.first_needed_block(n * self.block_size), n)]

    # --- pool ----------------------------------------------------------------------------
    def _take(self, block_id: int) -> None:
        if self.ref_count[block_id] == 0:
            del self.evictable_block_ids[block_id]
        self.ref_count[block_id] += 1

    def _allocate(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        else:
            block_id, _ = self.evictable_block_ids.popitem(last=False)
            del self.cached_block_ids[self.block_hash[block_id]]
            self.block_hash[block_id], self.token_ids[block_id] = None, ()
        self.ref_count[block_id] = 1
        return block_id

    def _release(self, block_id: int) -> None:
        assert self.ref_count[block_id] > 0, f"double free of local block {block_id}"
        self.ref_count[block_id] -= 1
        if self.ref_count[block_id] == 0:
            if self.block_hash[block_id] is None:
                self.free_block_ids.append(block_id)
            else:
                self.evictable_block_ids[block_id] = None

    # --- paired verbs, called by the BlockManager's -----------------------------------------
    def can_allocate(self, hashes, token_ids, num_cached_blocks: int, num_new_tokens: int) -> bool:
        hits = self._window_hits(hashes, token_ids, num_cached_blocks)
        num_needed = -(-(num_cached_blocks * self.block_size + num_new_tokens) // self.block_size) - num_cached_blocks
        num_revived = sum(1 for b in hits if self.ref_count[b] == 0)
        return num_needed <= self.num_free_blocks - num_revived

    def allocate(self, request_id: str, hashes, token_ids, num_cached_blocks: int, num_new_tokens: int) -> None:
        assert request_id not in self.tables
        first = self.first_needed_block(num_cached_blocks * self.block_size)
        table = [FREED] * first
        for block_id in self._window_hits(hashes, token_ids, num_cached_blocks):
            assert block_id is not None, "allocate a prefix usable_prefix admitted"
            self._take(block_id)
            table.append(block_id)
        self.tables[request_id] = table
        self.append_slots(request_id, num_cached_blocks * self.block_size, num_new_tokens)

    def can_append_slots(self, request_id: str, num_computed_tokens: int, num_new_tokens: int) -> bool:
        num_needed = -(-(num_computed_tokens + num_new_tokens) // self.block_size) - len(self.table(request_id))
        return num_needed <= self.num_free_blocks

    def append_slots(self, request_id: str, num_computed_tokens: int, num_new_tokens: int) -> None:
        table = self.tables.setdefault(request_id, [])
        num_needed = -(-(num_computed_tokens + num_new_tokens) // self.block_size) - len(table)
        assert num_needed <= self.num_free_blocks, "call can_append_slots first"
        for _ in range(num_needed):
            table.append(self._allocate())

    def num_appendable_tokens(self, request_id: str, num_computed_tokens: int) -> int:
        return (len(self.table(request_id)) + self.num_free_blocks) * self.block_size - num_computed_tokens

    def deallocate(self, request_id: str) -> None:
        for block_id in reversed(self.tables.pop(request_id, [])):
            if block_id != FREED:
                self._release(block_id)

    def cache_and_trim(self, request_id: str, hashes: list[bytes] | None, token_ids, num_computed_tokens: int) -> None:
        """Register the sequence's full computed blocks (hashes given: prefix caching is on),
        then give back the blocks no later query reads."""
        table = self.tables.get(request_id)
        if table is None:
            return
        if hashes is not None:
            for i in range(min(len(hashes), len(table))):
                block_id = table[i]
                if block_id == FREED or self.block_hash[block_id] is not None or hashes[i] in self.cached_block_ids:
                    continue
                self.block_hash[block_id], self.token_ids[block_id] = hashes[i], token_ids(i)
                self.cached_block_ids[hashes[i]] = block_id
        for i in range(min(self.first_needed_block(num_computed_tokens), len(table))):
            if table[i] != FREED:
                self._release(table[i])
                table[i] = FREED

    def rollback(self, request_id: str, num_kept_tokens: int) -> None:
        """Free the blocks past num_kept_tokens (rejected drafts); a partly filled tail block
        leaves the prefix cache, as its slots get rewritten."""
        table = self.tables.get(request_id)
        if table is None:
            return
        num_kept = -(-num_kept_tokens // self.block_size)
        for block_id in reversed(table[num_kept:]):
            if block_id != FREED:
                self._release(block_id)
        del table[num_kept:]
        if num_kept_tokens % self.block_size and len(table) == num_kept and table[-1] != FREED:
            tail = table[-1]
            if self.block_hash[tail] is not None:
                assert self.ref_count[tail] == 1, "rollback into a local block another sequence shares"
                del self.cached_block_ids[self.block_hash[tail]]
                self.block_hash[tail], self.token_ids[tail] = None, ()

    def reset_prefix_cache(self) -> None:
        while self.evictable_block_ids:
            block_id, _ = self.evictable_block_ids.popitem(last=False)
            del self.cached_block_ids[self.block_hash[block_id]]
            self.block_hash[block_id], self.token_ids[block_id] = None, ()
            self.free_block_ids.append(block_id)
