"""KV cache memory in fixed-size blocks, with automatic prefix caching.

Each sequence owns a block table (logical block i -> physical block id); token at position
p lives in slot `block_table[p // block_size] * block_size + p % block_size`. Blocks are
reference counted, so sequences with a common prefix share its blocks.

Prefix caching: once every token of a full block is computed, the block is registered
under a chained hash (the previous block's hash + this block's token ids). A new sequence
reuses the longest run of registered blocks matching its prefix (a hit is confirmed by
comparing token ids). Blocks nobody references but still registered stay reusable until
they are evicted, least recently freed first. A sequence's last token is never served
from the cache: the model has to compute it to produce the next token's logits.

Lower tiers (`KVTier`, e.g. the disk cache): every newly registered block is also handed to
each tier to keep, and before a waiting sequence is admitted, `load_prefix` copies the blocks
of its prefix that the pool lacks but a tier holds into fresh blocks, registered as if they had
been computed here, so admission then finds them as ordinary cache hits. A host-RAM tier for
blocks a GPU pool evicts would be one more tier in the list; on a CPU-only machine the pool
already is host memory, so there is none.

Sliding-window (local) layers, as Gemma 3's, keep their KV in a second pool with a table per
sequence that drops the blocks out of the window (localrun/engine/window_blocks.py): every
verb here acts on both pools, and a prefix hit counts only as far as the local pool still holds
the window its next query reads.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Protocol

from localrun.engine.sequence import Sequence
from localrun.engine.window_blocks import WindowBlocks


def hash_block(parent_hash: bytes, token_ids: list[int]) -> bytes:
    """Stable chained hash of a full block: blake2b(parent hash + little-endian int64 ids)."""
    data = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.blake2b(parent_hash + data, digest_size=16).digest()


def slot_mapping(block_table: list[int], block_size: int, start: int, num_tokens: int) -> list[int]:
    """Physical KV slot of each token at positions start .. start + num_tokens - 1."""
    return [block_table[p // block_size] * block_size + p % block_size
            for p in range(start, start + num_tokens)]


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None   # set while the block is registered in the prefix cache
    token_ids: tuple[int, ...] = ()   # the registered content, to confirm a hash hit
    tier: str | None = None           # loaded from this lower tier and not yet used by a sequence


class KVTier(Protocol):
    """Storage below the block pool, keyed by a block's chained hash (torch-free interface;
    the implementation moves the block's K/V between the pool and its storage)."""
    name: str

    def contains(self, block_hash: bytes) -> bool:
        """Cheap: no K/V is read."""

    def load(self, block_hash: bytes, token_ids: tuple[int, ...], block_id: int) -> bool:
        """Copy the stored block into pool block block_id; False if missing or unusable."""

    def store(self, blocks: list[tuple[bytes, tuple[int, ...], int]]) -> None:
        """Keep a copy of these (hash, token ids, pool block id) blocks; must not block for long."""

    def set_busy(self, busy: bool) -> None:
        """The engine has requests in flight (True) or none (False): slow work such as disk
        writes waits for the idle time between requests, so it never competes with a step."""


@dataclass
class PrefixCacheStats:
    num_queries: int = 0        # admissions that looked the prefix up
    num_query_tokens: int = 0   # tokens those sequences held
    num_hit_tokens: int = 0     # tokens served from the cache
    num_hits: int = 0           # blocks served from the cache
    num_misses: int = 0         # full blocks looked up and not found
    num_evictions: int = 0      # registered blocks reused for other content
    num_tier_hit_tokens: dict[str, int] = field(default_factory=dict)  # of num_hit_tokens, by tier
    num_tier_loaded_blocks: dict[str, int] = field(default_factory=dict)  # copied in by load_prefix

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


class BlockManager:

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 hash_seed: bytes = b"", lower_tiers: list[KVTier] | None = None,
                 num_local_blocks: int = 0, sliding_window: int | None = None):
        """num_local_blocks, sliding_window: the local layers' pool (none when 0 / None)."""
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_seed = hash_seed    # root of every hash chain: namespaces model / kv_type
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))       # unregistered, ref 0
        self.evictable_block_ids: OrderedDict[int, None] = OrderedDict()  # registered, ref 0, LRU first
        self.cached_block_ids: dict[bytes, int] = {}                      # hash -> registered block
        self.stats = PrefixCacheStats()
        self.lower_tiers: list[KVTier] = list(lower_tiers or [])   # checked in order
        self.window: WindowBlocks | None = (WindowBlocks(num_local_blocks, block_size, sliding_window)
                                            if num_local_blocks and sliding_window else None)

    def local_block_table(self, seq: Sequence) -> list[int]:
        """seq's block table in the local layers' pool (FREED where out of the window)."""
        assert self.window is not None
        return self.window.table(seq.request_id)

    def _token_ids_of(self, seq: Sequence):
        bs = self.block_size
        return lambda i: tuple(seq.token_ids[i * bs:(i + 1) * bs])

    # --- counters -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (never used, or cached and unreferenced)."""
        return len(self.free_block_ids) + len(self.evictable_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, referenced or not."""
        return len(self.cached_block_ids)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self.evictable_block_ids)

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix lookup --------------------------------------------------------------
    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chained hashes of seq's first num_blocks full blocks (memoized on seq)."""
        bs, hashes = self.block_size, seq.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else self.hash_seed
            hashes.append(hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs]))
        return hashes[:num_blocks]

    def _find_cached_blocks(self, seq: Sequence) -> list[int]:
        """Registered blocks holding seq's longest cached prefix, excluding its last token."""
        if not self.enable_prefix_caching:
            return []
        bs, found = self.block_size, []
        for i, h in enumerate(self._block_hashes(seq, (seq.num_tokens - 1) // bs)):
            block_id = self.cached_block_ids.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(seq.token_ids[i * bs:(i + 1) * bs]):
                break
            found.append(block_id)
        if self.window is not None and found:     # usable as far as the local window is cached too
            found = found[:self.window.usable_prefix(seq.block_hashes[:len(found)], self._token_ids_of(seq))]
        return found

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens an allocation of seq would take from the prefix cache now (no side effects)."""
        return len(self._find_cached_blocks(seq)) * self.block_size

    # --- block pool -----------------------------------------------------------------
    def _take_block(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            assert block.block_hash is not None, "only registered blocks are taken by id"
            del self.evictable_block_ids[block_id]
        block.ref_count += 1

    def _allocate_block(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        else:
            block_id, _ = self.evictable_block_ids.popitem(last=False)
            block = self.blocks[block_id]
            del self.cached_block_ids[block.block_hash]
            block.block_hash, block.token_ids, block.tier = None, (), None
            self.stats.num_evictions += 1
        block = self.blocks[block_id]
        assert block.ref_count == 0 and block.block_hash is None
        block.ref_count = 1
        return block_id

    def _release_block(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"double free of block {block_id}"
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is None:
                self.free_block_ids.append(block_id)
            else:
                self.evictable_block_ids[block_id] = None   # most recently freed last

    # --- paired verbs -----------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Can seq be admitted: its cached prefix plus num_new_tokens more tokens?"""
        cached = self._find_cached_blocks(seq)
        num_needed = self.num_blocks_needed(len(cached) * self.block_size + num_new_tokens) - len(cached)
        num_revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        if self.window is not None and not self.window.can_allocate(seq.block_hashes, self._token_ids_of(seq),
                                                                    len(cached), num_new_tokens):
            return False
        return num_needed <= self.num_free_blocks - num_revived

    def num_blocks_to_admit(self, seq: Sequence, num_tokens: int) -> int:
        """Free blocks that seq would take to hold its first num_tokens tokens: the new ones
        past its cached prefix, plus the cached ones nobody references (they leave the free list)."""
        cached = self._find_cached_blocks(seq)
        num_needed = max(self.num_blocks_needed(num_tokens) - len(cached), 0)
        return num_needed + sum(1 for b in cached if self.blocks[b].ref_count == 0)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Admit seq: share its cached prefix blocks, then add slots for num_new_tokens tokens."""
        assert not seq.block_table and seq.num_computed_tokens == 0, "sequence already holds blocks"
        cached = self._find_cached_blocks(seq)
        from_tier: dict[str, int] = {}
        for block_id in cached:
            self._take_block(block_id)
            block = self.blocks[block_id]
            if block.tier is not None:   # its first use: count it for the tier, later it is a device hit
                from_tier[block.tier] = from_tier.get(block.tier, 0) + self.block_size
                block.tier = None
        seq.block_table = list(cached)
        seq.num_cached_tokens = seq.num_computed_tokens = len(cached) * self.block_size
        if self.window is not None:
            self.window.allocate(seq.request_id, seq.block_hashes, self._token_ids_of(seq), len(cached), 0)
        if seq.timeline.first_scheduled is None:    # the timeline reports the first admission
            seq.timeline.cached_tokens_by_tier = from_tier
        for name, num_tokens in from_tier.items():
            self.stats.num_tier_hit_tokens[name] = self.stats.num_tier_hit_tokens.get(name, 0) + num_tokens
        if self.enable_prefix_caching:
            self.stats.num_queries += 1
            self.stats.num_query_tokens += seq.num_tokens
            self.stats.num_hit_tokens += seq.num_cached_tokens
            self.stats.num_hits += len(cached)
            self.stats.num_misses += (seq.num_tokens - 1) // self.block_size - len(cached)
        self.append_slots(seq, num_new_tokens)

    def can_append_slots(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        """Are there blocks for num_new_tokens tokens past seq's computed ones?"""
        num_needed = self.num_blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if self.window is not None and not self.window.can_append_slots(seq.request_id, seq.num_computed_tokens,
                                                                        num_new_tokens):
            return False
        return num_needed <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int = 1) -> None:
        """Grow seq's block table to hold num_new_tokens tokens past its computed ones."""
        num_needed = self.num_blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        assert num_needed <= self.num_free_blocks, "call can_append_slots first"
        for _ in range(num_needed):
            seq.block_table.append(self._allocate_block())
        if self.window is not None:
            self.window.append_slots(seq.request_id, seq.num_computed_tokens, num_new_tokens)

    def num_appendable_tokens(self, seq: Sequence) -> int:
        """The most tokens append_slots can take for seq now."""
        num = (len(seq.block_table) + self.num_free_blocks) * self.block_size - seq.num_computed_tokens
        if self.window is not None:
            num = min(num, self.window.num_appendable_tokens(seq.request_id, seq.num_computed_tokens))
        return num

    def deallocate(self, seq: Sequence) -> None:
        """Drop seq's blocks (its computed K/V). Registered blocks stay cached until evicted."""
        for block_id in reversed(seq.block_table):   # tail first: evicted before the shared head
            self._release_block(block_id)
        if self.window is not None:
            self.window.deallocate(seq.request_id)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register seq's fully computed blocks in the prefix cache (prompt and generated); in
        the local pool, also give back the blocks out of seq's window."""
        if self.window is not None:
            hashes = (self._block_hashes(seq, seq.num_computed_tokens // self.block_size)
                      if self.enable_prefix_caching else None)
            self.window.cache_and_trim(seq.request_id, hashes, self._token_ids_of(seq), seq.num_computed_tokens)
        if not self.enable_prefix_caching:
            return
        bs, table = self.block_size, seq.block_table
        num_full = seq.num_computed_tokens // bs
        first = num_full                        # registered blocks form a prefix of the table
        while first > 0 and self.blocks[table[first - 1]].block_hash is None:
            first -= 1
        hashes = self._block_hashes(seq, num_full)
        registered = []
        for i in range(first, num_full):
            token_ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            existing = self.cached_block_ids.get(hashes[i])
            if existing is not None:            # same content computed twice: share the cached one
                if self.blocks[existing].token_ids != token_ids:
                    continue                    # a hash collision: keep ours, unregistered
                self._take_block(existing)
                self._release_block(table[i])
                table[i] = existing
                continue
            block = self.blocks[table[i]]
            assert block.ref_count == 1, "an unregistered block belongs to one sequence"
            block.block_hash, block.token_ids = hashes[i], token_ids
            self.cached_block_ids[hashes[i]] = table[i]
            registered.append((hashes[i], token_ids, table[i]))
        if registered:
            for tier in self.lower_tiers:
                tier.store(registered)

    def load_prefix(self, seq: Sequence) -> int:
        """Copy the blocks of seq's prefix that follow its cached ones in the pool from the lower
        tiers into free blocks, registered and unreferenced, for `allocate` to find. Stops at the
        first block no tier has, and before it would evict a block of seq's own prefix.
        Returns the number of blocks loaded."""
        if not (self.enable_prefix_caching and self.lower_tiers) or seq.block_table:
            return 0
        bs, chain, num_loaded = self.block_size, set(), 0
        for i, h in enumerate(self._block_hashes(seq, (seq.num_tokens - 1) // bs)):
            token_ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            block_id = self.cached_block_ids.get(h)
            if block_id is not None:
                if self.blocks[block_id].token_ids != token_ids:
                    break                              # a hash collision: stop as _find_cached_blocks does
                chain.add(block_id)
                if block_id in self.evictable_block_ids:   # most recently used: evicted last
                    self.evictable_block_ids.move_to_end(block_id)
                continue
            tier = next((t for t in self.lower_tiers if t.contains(h)), None)
            if tier is None or not self._can_load_without_evicting(chain):
                break
            block_id = self._allocate_block()
            if not tier.load(h, token_ids, block_id):
                self._release_block(block_id)
                break
            block = self.blocks[block_id]
            block.block_hash, block.token_ids, block.tier = h, token_ids, tier.name
            self.cached_block_ids[h] = block_id
            self._release_block(block_id)              # registered, ref 0: evictable, most recent
            chain.add(block_id)
            num_loaded += 1
            self.stats.num_tier_loaded_blocks[tier.name] = self.stats.num_tier_loaded_blocks.get(tier.name, 0) + 1
        return num_loaded

    def _can_load_without_evicting(self, chain: set[int]) -> bool:
        """Is there a block to load into that is not part of the prefix being assembled?"""
        if self.free_block_ids:
            return True
        oldest = next(iter(self.evictable_block_ids), None)
        return oldest is not None and oldest not in chain

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Remove seq's last num_tokens tokens (rejected drafts) and free the slots past its end.

        rollback(seq, 0) only frees slots reserved past the last token. Call it before
        cache_full_blocks sees the rejected tokens as computed.
        """
        assert 0 <= num_tokens <= seq.num_generated_tokens, "only generated tokens roll back"
        bs, num_kept = self.block_size, seq.num_tokens - num_tokens
        del seq.token_ids[num_kept:]
        del seq.block_hashes[num_kept // bs:]
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_kept)
        seq.num_cached_tokens = min(seq.num_cached_tokens, num_kept)
        num_blocks_kept = self.num_blocks_needed(num_kept)
        if self.window is not None:
            self.window.rollback(seq.request_id, num_kept)
        for block_id in reversed(seq.block_table[num_blocks_kept:]):
            self._release_block(block_id)
        del seq.block_table[num_blocks_kept:]
        if num_kept % bs and len(seq.block_table) == num_blocks_kept:
            tail = self.blocks[seq.block_table[-1]]   # partly filled again: its slots get rewritten
            if tail.block_hash is not None:
                assert tail.ref_count == 1, "rollback into a block another sequence shares"
                del self.cached_block_ids[tail.block_hash]
                tail.block_hash, tail.token_ids, tail.tier = None, (), None

    def reset_prefix_cache(self) -> None:
        """Forget every unreferenced cached block (e.g. to benchmark without the cache)."""
        while self.evictable_block_ids:
            block_id, _ = self.evictable_block_ids.popitem(last=False)
            block = self.blocks[block_id]
            del self.cached_block_ids[block.block_hash]
            block.block_hash, block.token_ids, block.tier = None, (), None
            self.free_block_ids.append(block_id)
        if self.window is not None:
            self.window.reset_prefix_cache()
