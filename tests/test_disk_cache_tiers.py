"""BlockManager with a lower tier (torch-free): a fake tier that remembers which "content" each
pool block holds, so loading, counting and eviction are checked against hand-computed figures."""
from __future__ import annotations

from localrun.engine.block_manager import BlockManager
from localrun.engine.sequence import Sequence

BS = 4


class FakeTier:
    name = "disk"

    def __init__(self):
        self.blocks: dict[bytes, tuple[int, ...]] = {}   # hash -> token ids stored
        self.pool: dict[int, tuple[int, ...]] = {}       # pool block id -> what was loaded into it
        self.stored: list[bytes] = []
        self.fail: set[bytes] = set()                    # loads of these fail (corrupt files)

    def contains(self, block_hash):
        return block_hash in self.blocks

    def load(self, block_hash, token_ids, block_id):
        if block_hash in self.fail or self.blocks[block_hash] != token_ids:
            return False
        self.pool[block_id] = token_ids
        return True

    def store(self, blocks):
        for block_hash, token_ids, _ in blocks:
            self.stored.append(block_hash)
            self.blocks[block_hash] = token_ids


def prefill(bm, seq):
    num_new = seq.num_tokens - bm.num_cached_prefix_tokens(seq)
    assert bm.can_allocate(seq, num_new)
    bm.allocate(seq, num_new)
    seq.num_computed_tokens += num_new
    bm.cache_full_blocks(seq)


def warm_tier(ids, tier):
    """A first 'process' computes ids and hands its full blocks to the tier."""
    bm = BlockManager(16, BS, lower_tiers=[tier])
    seq = Sequence("a", ids)
    prefill(bm, seq)
    return bm


def test_registered_blocks_are_stored_once():
    tier = FakeTier()
    bm = warm_tier(list(range(10, 23)), tier)                 # 13 tokens: 3 full blocks
    assert len(tier.stored) == 3
    prefill(bm, Sequence("b", list(range(10, 23))))           # a device hit: nothing new to store
    assert len(tier.stored) == 3


def test_load_prefix_fills_the_pool_and_counts_the_tier():
    tier = FakeTier()
    ids = list(range(10, 23))
    warm_tier(ids, tier)
    bm = BlockManager(16, BS, lower_tiers=[tier])             # "the next process": empty pool
    seq = Sequence("b", ids)
    assert bm.num_cached_prefix_tokens(seq) == 0
    assert bm.load_prefix(seq) == 3                           # (13 - 1) // 4 blocks
    assert bm.num_cached_prefix_tokens(seq) == 12 and bm.num_evictable_blocks == 3
    prefill(bm, seq)
    assert seq.num_cached_tokens == 12 and seq.timeline.cached_tokens_by_tier == {"disk": 12}
    assert [tier.pool[b] for b in seq.block_table[:3]] == [tuple(ids[i:i + 4]) for i in (0, 4, 8)]
    assert bm.stats.num_tier_hit_tokens == {"disk": 12}
    other = Sequence("c", ids)                                # now the blocks are a device hit
    prefill(bm, other)
    assert other.timeline.cached_tokens_by_tier == {} and other.num_cached_tokens == 12
    assert bm.stats.num_tier_hit_tokens == {"disk": 12}
    assert len(tier.stored) == 3                              # loaded blocks are not stored again


def test_load_stops_at_a_missing_or_failing_block():
    tier = FakeTier()
    ids = list(range(10, 30))                                 # 20 tokens: 4 blocks looked up
    warm_tier(ids, tier)
    hashes = list(tier.blocks)
    tier.fail.add(hashes[2])
    bm = BlockManager(16, BS, lower_tiers=[tier])
    seq = Sequence("b", ids)
    assert bm.load_prefix(seq) == 2
    assert bm.num_free_blocks == 16 and len(bm.free_block_ids) == 14   # the failed block went back
    assert bm.load_prefix(seq) == 0                           # idempotent: stops at the same place
    del tier.blocks[hashes[1]]
    bm = BlockManager(16, BS, lower_tiers=[tier])
    assert bm.load_prefix(Sequence("c", ids)) == 1


def test_load_continues_after_blocks_already_in_the_pool():
    tier = FakeTier()
    ids = list(range(10, 30))
    warm_tier(ids, tier)
    bm = BlockManager(16, BS, lower_tiers=[])
    prefill(bm, Sequence("short", ids[:9]))                   # 2 blocks computed here
    bm.lower_tiers.append(tier)
    seq = Sequence("b", ids)
    assert bm.load_prefix(seq) == 2                           # blocks 2 and 3 from the tier
    prefill(bm, seq)
    assert seq.num_cached_tokens == 16 and seq.timeline.cached_tokens_by_tier == {"disk": 8}


def test_load_never_evicts_the_prefix_it_builds():
    tier = FakeTier()
    ids = list(range(10, 42))                                 # 32 tokens: 7 blocks looked up
    warm_tier(ids, tier)
    bm = BlockManager(4, BS, lower_tiers=[tier])              # a pool of 4 blocks
    seq = Sequence("b", ids)
    assert bm.load_prefix(seq) == 4
    assert bm.num_cached_prefix_tokens(seq) == 16             # all four are the prefix's first blocks


def test_loaded_but_unused_blocks_are_evicted_like_others():
    tier = FakeTier()
    ids = list(range(10, 23))
    warm_tier(ids, tier)
    bm = BlockManager(4, BS, lower_tiers=[tier])
    assert bm.load_prefix(Sequence("b", ids)) == 3
    other = Sequence("c", list(range(100, 116)))              # needs all 4 blocks
    prefill(bm, other)
    assert bm.stats.num_evictions == 3 and bm.num_cached_blocks == 4
    assert all(b.tier is None for b in bm.blocks)             # evicted blocks forget their tier


def test_no_tier_work_without_prefix_caching():
    tier = FakeTier()
    ids = list(range(10, 23))
    warm_tier(ids, tier)
    bm = BlockManager(16, BS, enable_prefix_caching=False, lower_tiers=[tier])
    assert bm.load_prefix(Sequence("b", ids)) == 0
