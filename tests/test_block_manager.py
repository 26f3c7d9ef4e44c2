"""BlockManager: block tables, ref counts, prefix caching, rollback, against hand-computed figures,
plus a hypothesis state machine that checks the pool's invariants and a fake KV store's content."""
import hashlib
import struct

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from localrun.engine.block_manager import BlockManager, hash_block, slot_mapping
from localrun.engine.sequence import Sequence


def compute(bm, seq, num_tokens, register=True):
    """What a step does to seq: reserve slots, 'write K/V', advance, register full blocks."""
    bm.append_slots(seq, num_tokens)
    seq.num_computed_tokens += num_tokens
    if register:
        bm.cache_full_blocks(seq)


def admit(bm, seq):
    """Admit seq and compute all its tokens, as a prefill would."""
    num_new = seq.num_tokens - bm.num_cached_prefix_tokens(seq)
    assert bm.can_allocate(seq, num_new)
    bm.allocate(seq, num_new)
    seq.num_computed_tokens += num_new
    bm.cache_full_blocks(seq)


# --- pure helpers ---------------------------------------------------------------------

def test_slot_mapping_hand_computed():
    # block size 4, table [7, 2, 5]: position p -> table[p // 4] * 4 + p % 4
    assert slot_mapping([7, 2, 5], 4, 2, 8) == [30, 31, 8, 9, 10, 11, 20, 21]


def test_hash_is_chained_stable_and_pinned():
    expected = hashlib.blake2b(struct.pack("<4q", 1, 2, 3, 4), digest_size=16).digest()
    assert hash_block(b"", [1, 2, 3, 4]) == expected
    # pinned so that a persisted prefix cache notices a format change
    assert expected.hex() == "087a24230771ee662be37e5493b333d7"
    child = hash_block(expected, [5, 6, 7, 8])
    assert child.hex() == "8222aab65152a8711ac413a3333a672c"
    assert hash_block(b"other parent", [5, 6, 7, 8]) != child


# --- allocation and prefix caching ---------------------------------------------------------

def test_allocate_fresh_sequence():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Sequence("a", list(range(10)))
    assert bm.can_allocate(seq, 10)
    bm.allocate(seq, 10)
    assert seq.block_table == [0, 1, 2]
    assert (bm.num_used_blocks, bm.num_free_blocks, bm.num_cached_blocks) == (3, 5, 0)
    assert seq.num_computed_tokens == seq.num_cached_tokens == 0
    assert bm.stats.num_misses == 2   # full blocks among the first 9 tokens
    assert slot_mapping(seq.block_table, bm.block_size, 6, 4) == [6, 7, 8, 9]


def test_prefix_hit_shares_blocks_and_stops_at_first_mismatch():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Sequence("a", list(range(10)))
    admit(bm, a)
    assert bm.num_cached_blocks == 2   # tokens 0..7; block 2 holds only 8, 9
    b = Sequence("b", list(range(8)) + [50, 51, 52])
    assert bm.num_cached_prefix_tokens(b) == 8
    bm.allocate(b, 3)
    assert b.block_table == [0, 1, 3]
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert [bm.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    assert (bm.stats.num_hits, bm.stats.num_hit_tokens) == (2, 8)
    c = Sequence("c", [0, 1, 2, 3, 99, 5, 6, 7, 8, 9])   # second block differs
    assert bm.num_cached_prefix_tokens(c) == 4
    d = Sequence("d", [9, 1, 2, 3, 4, 5, 6, 7, 8, 9])    # first block differs: chain broken
    assert bm.num_cached_prefix_tokens(d) == 0


def test_last_prompt_token_is_always_computed():
    bm = BlockManager(num_blocks=8, block_size=4)
    admit(bm, Sequence("a", list(range(8))))
    assert bm.num_cached_blocks == 2
    same = Sequence("b", list(range(8)))
    assert bm.num_cached_prefix_tokens(same) == 4   # not 8: token 7 must produce logits
    bm.allocate(same, 4)
    assert same.block_table == [0, 2]


def test_hit_is_confirmed_by_token_ids():
    bm = BlockManager(num_blocks=8, block_size=4)
    admit(bm, Sequence("a", list(range(9))))
    bm.blocks[0].token_ids = (0, 1, 2, 42)      # as if another content had the same hash
    assert bm.num_cached_prefix_tokens(Sequence("b", list(range(9)))) == 0


def test_unreferenced_cached_blocks_are_evicted_tail_first():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = Sequence("a", list(range(13)))
    admit(bm, a)                      # blocks 0, 1, 2 full and registered, block 3 partial
    bm.deallocate(a)
    assert (bm.num_used_blocks, bm.num_free_blocks, bm.num_cached_blocks) == (0, 4, 3)
    assert list(bm.evictable_block_ids) == [2, 1, 0]    # the tail goes first
    d = Sequence("d", [100 + i for i in range(8)])
    bm.allocate(d, 8)
    assert d.block_table == [3, 2]     # the never-cached block first, then A's tail
    assert bm.stats.num_evictions == 1
    e = Sequence("e", list(range(8)) + [42])
    assert bm.num_cached_prefix_tokens(e) == 8      # A's head survived


def test_can_allocate_does_not_count_revived_blocks_as_free():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = Sequence("a", list(range(9)))
    admit(bm, a)
    bm.deallocate(a)                   # free: block 2; evictable: blocks 0 and 1
    assert bm.num_free_blocks == 3
    long = Sequence("b", list(range(8)) + [9, 10, 11, 12, 13])     # 2 cached + 2 new blocks
    assert not bm.can_allocate(long, 5)
    short = Sequence("c", list(range(8)) + [9, 10, 11])            # 2 cached + 1 new block
    assert bm.can_allocate(short, 3)
    bm.allocate(short, 3)
    assert short.block_table == [0, 1, 2] and bm.num_free_blocks == 0


def test_generated_tokens_are_reused_by_the_next_chat_turn():
    bm = BlockManager(num_blocks=8, block_size=4)
    turn1 = Sequence("t1", [1, 2, 3, 4, 5, 6])
    admit(bm, turn1)
    for token in [70, 71, 72, 73]:                  # decode: sample, then compute it next step
        turn1.append_token(token)
        compute(bm, turn1, 1)
    assert turn1.num_computed_tokens == 10 and bm.num_cached_blocks == 2
    bm.deallocate(turn1)
    turn2 = Sequence("t2", turn1.token_ids + [80, 81, 82])
    assert bm.num_cached_prefix_tokens(turn2) == 8   # includes generated tokens 70, 71


def test_same_content_computed_twice_is_shared():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = Sequence("a", list(range(9))), Sequence("b", list(range(9)))
    bm.allocate(a, 9)
    bm.allocate(b, 9)                  # admitted in one step: both miss
    assert bm.num_used_blocks == 6
    for seq in (a, b):
        seq.num_computed_tokens = 9
        bm.cache_full_blocks(seq)
    assert b.block_table[:2] == a.block_table[:2] == [0, 1]
    assert bm.num_used_blocks == 4 and bm.blocks[0].ref_count == 2


def test_rollback_frees_blocks_and_unregisters_a_reopened_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Sequence("a", [1, 2, 3])
    admit(bm, seq)
    for token in [4, 5, 6, 7]:          # the sampled token plus three drafts
        seq.append_token(token)
    compute(bm, seq, 4)                 # verify all four in one step
    assert seq.block_table == [0, 1] and bm.num_cached_blocks == 1
    bm.rollback(seq, 2)                 # reject the last two drafts
    assert seq.token_ids == [1, 2, 3, 4, 5] and seq.num_computed_tokens == 5
    assert seq.block_table == [0, 1]
    bm.rollback(seq, 2)                 # block 0 becomes partial: leaves the cache
    assert seq.token_ids == [1, 2, 3] and seq.block_table == [0]
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 7
    assert seq.block_hashes == []


def test_rollback_zero_frees_reserved_slots():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Sequence("a", [1, 2, 3, 4, 5])
    bm.allocate(seq, 5)
    bm.append_slots(seq, 12)            # reserve room for drafts: 3 blocks
    assert len(seq.block_table) == 3
    bm.rollback(seq, 0)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = Sequence("a", list(range(9)))
    admit(bm, a)
    bm.deallocate(a)
    assert bm.num_cached_blocks == 0 and len(bm.free_block_ids) == 8
    assert bm.num_cached_prefix_tokens(Sequence("b", list(range(9)))) == 0


def test_reset_prefix_cache_and_hit_rate():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Sequence("a", list(range(9)))
    admit(bm, a)
    b = Sequence("b", list(range(9)))
    admit(bm, b)
    assert bm.stats.hit_rate == 8 / 18
    bm.deallocate(a)
    bm.deallocate(b)
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and len(bm.free_block_ids) == 8


# --- property: random interleavings keep the pool and the K/V content consistent ------------

BASE = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 0, 3]   # prompts share prefixes of this


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=10, block_size=4)
        self.live: list[Sequence] = []
        self.kv: dict[int, tuple[int, int]] = {}   # slot -> (token id, position) written there
        self.num_created = 0

    def write(self, seq, num_tokens):
        """Fake forward: write (token, position) to each new slot, never into a shared block."""
        start = seq.num_computed_tokens
        for p, slot in zip(range(start, start + num_tokens), slot_mapping(seq.block_table, self.bm.block_size, start, num_tokens)):
            block = self.bm.blocks[slot // self.bm.block_size]
            assert block.ref_count == 1 and block.block_hash is None, "write into a shared block"
            self.kv[slot] = (seq.token_ids[p], p)

    @rule(prefix_len=st.integers(0, len(BASE)), tail=st.lists(st.integers(0, 9), max_size=6),
          chunk=st.integers(1, 20))
    def admit(self, prefix_len, tail, chunk):
        seq = Sequence(f"s{self.num_created}", BASE[:prefix_len] + tail or [1])
        self.num_created += 1
        num_new = min(chunk, seq.num_tokens - self.bm.num_cached_prefix_tokens(seq))
        if not self.bm.can_allocate(seq, num_new):
            return
        self.bm.allocate(seq, num_new)
        assert seq.num_cached_tokens <= seq.num_tokens - 1
        self.write(seq, num_new)
        seq.num_computed_tokens += num_new
        self.bm.cache_full_blocks(seq)
        self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100), chunk=st.integers(1, 12), token=st.integers(0, 9))
    def step(self, index, chunk, token):
        seq = self.live[index % len(self.live)]
        if seq.num_uncomputed_tokens == 0:
            seq.append_token(token)                 # sampled after the last step
        num_new = min(chunk, seq.num_uncomputed_tokens)
        if not self.bm.can_append_slots(seq, num_new):
            return
        self.bm.append_slots(seq, num_new)
        self.write(seq, num_new)
        seq.num_computed_tokens += num_new
        self.bm.cache_full_blocks(seq)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100), drafts=st.lists(st.integers(0, 9), min_size=1, max_size=6),
          num_rejected=st.integers(0, 6))
    def speculate(self, index, drafts, num_rejected):
        """Verify drafts in one step, roll back the rejected ones, then register blocks."""
        seq = self.live[index % len(self.live)]
        if seq.num_uncomputed_tokens != 1:
            return
        seq.token_ids.extend(drafts)
        if not self.bm.can_append_slots(seq, 1 + len(drafts)):
            self.bm.rollback(seq, len(drafts))
            return
        self.bm.append_slots(seq, 1 + len(drafts))
        self.write(seq, 1 + len(drafts))
        seq.num_computed_tokens += 1 + len(drafts)
        self.bm.rollback(seq, min(num_rejected, len(drafts)))
        self.bm.cache_full_blocks(seq)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100), num_tokens=st.integers(1, 6))
    def roll_back_generated(self, index, num_tokens):
        """Roll back computed, registered tokens, unless that would reopen a shared block."""
        seq, bm = self.live[index % len(self.live)], self.bm
        num_tokens = min(num_tokens, seq.num_generated_tokens)
        num_kept = seq.num_tokens - num_tokens
        num_blocks_kept = bm.num_blocks_needed(num_kept)
        if num_kept % bm.block_size and num_blocks_kept <= len(seq.block_table):
            tail = bm.blocks[seq.block_table[num_blocks_kept - 1]]
            if tail.block_hash is not None and tail.ref_count > 1:
                return
        bm.rollback(seq, num_tokens)
        assert seq.num_tokens == num_kept and len(seq.block_table) <= num_blocks_kept

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def free(self, index):
        seq = self.live.pop(index % len(self.live))
        self.bm.deallocate(seq)
        assert seq.block_table == [] and seq.num_computed_tokens == 0

    @invariant()
    def pool_is_consistent(self):
        bm = self.bm
        holders = [0] * bm.num_blocks
        for seq in self.live:
            assert len(set(seq.block_table)) == len(seq.block_table)
            assert seq.num_computed_tokens <= len(seq.block_table) * bm.block_size
            for block_id in seq.block_table:
                holders[block_id] += 1
        assert [b.ref_count for b in bm.blocks] == holders
        free, evictable = list(bm.free_block_ids), list(bm.evictable_block_ids)
        assert len(set(free)) == len(free) and not set(free) & set(evictable)
        assert sorted(free + evictable) == [i for i, n in enumerate(holders) if n == 0]
        assert all(bm.blocks[i].block_hash is None for i in free)
        assert all(bm.blocks[i].block_hash is not None for i in evictable)
        assert {h: b.block_id for b in bm.blocks if (h := b.block_hash)} == bm.cached_block_ids
        assert bm.num_used_blocks + bm.num_free_blocks == bm.num_blocks

    @invariant()
    def kv_content_is_each_sequences_own(self):
        bs = self.bm.block_size
        for seq in self.live:
            for p in range(seq.num_computed_tokens):
                assert self.kv[slot_mapping(seq.block_table, bs, p, 1)[0]] == (seq.token_ids[p], p)
        for block in self.bm.blocks:          # a cached block holds exactly what its hash names
            if block.block_hash is not None:
                written = [self.kv[block.block_id * bs + i][0] for i in range(bs)]
                assert tuple(written) == block.token_ids

    def teardown(self):
        for seq in self.live:
            self.bm.deallocate(seq)
        assert self.bm.num_used_blocks == 0
        assert all(b.ref_count == 0 for b in self.bm.blocks)


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
