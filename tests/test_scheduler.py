"""Scheduler: batches, chunked prefill, preemption, abort and stop rules against hand-computed
steps, plus a hypothesis property: under any workload, budget, cache size and aborts, every
request finishes exactly once, with the same tokens as running it alone."""
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localrun.engine.block_manager import BlockManager, slot_mapping
from localrun.engine.scheduler import Scheduler, SchedulerConfig
from localrun.engine.sequence import Sequence, SequenceStatus
from localrun.errors import UserError

VOCAB, EOS = 20, 0


@dataclass(frozen=True)
class Params:
    """The fields of localrun.sampling.SamplingParams the scheduler reads (that module imports torch)."""
    max_tokens: int = 16
    ignore_eos: bool = False


def fake_next_token(context: list[int]) -> int:
    """A deterministic 'model': the next token is a hash of the whole context."""
    h = 0
    for token in context:
        h = (h * 31 + token + 1) % 1_000_003
    return h % VOCAB


class FakeRunner:
    """Writes (token, position) into a KV dict through the slot mapping, then samples by
    reading every context token back through the block table, as paged attention does."""

    def __init__(self, block_manager: BlockManager):
        self.block_manager = block_manager
        self.kv: dict[int, tuple[int, int]] = {}

    def run(self, batch):
        bm = self.block_manager
        for slot, token, position in zip(batch.slot_mapping(), batch.input_token_ids(), batch.positions()):
            block = bm.blocks[slot // bm.block_size]
            assert block.ref_count == 1 and block.block_hash is None, "write into a shared block"
            self.kv[slot] = (token, position)
        sampled = []
        for entry in batch.entries:
            if entry.samples_token:
                slots = slot_mapping(entry.seq.block_table, bm.block_size, 0, entry.end_position)
                context = [self.kv[s] for s in slots]
                assert [p for _, p in context] == list(range(entry.end_position))
                sampled.append(fake_next_token([t for t, _ in context]))
        assert len(sampled) == len(batch.sample_indices())
        return sampled


def reference_generate(prompt, params, max_model_len, eos=(EOS,)):
    """The same request alone, without a cache or a scheduler."""
    tokens = list(prompt)
    while True:
        tokens.append(fake_next_token(tokens))
        num_generated = len(tokens) - len(prompt)
        if tokens[-1] in eos and not params.ignore_eos:
            return tokens[len(prompt):], "stop"
        if (params.max_tokens and num_generated >= params.max_tokens) or len(tokens) >= max_model_len:
            return tokens[len(prompt):], "length"


def make(num_blocks=16, block_size=4, eos=(EOS,), **config):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(**config), bm, eos_token_ids=eos), FakeRunner(bm)


def step(scheduler, runner):
    batch = scheduler.schedule()
    return batch, scheduler.postprocess(batch, runner.run(batch))


def shape(batch):
    return [(e.seq.request_id, e.start_position, e.num_new_tokens) for e in batch.entries]


# --- hand-computed steps --------------------------------------------------------------------

def test_batch_describes_prefills_then_decodes():
    scheduler, runner = make(max_num_seqs=4, max_num_batched_tokens=64)
    a = Sequence("a", [1, 2, 3, 4, 5], Params(max_tokens=5, ignore_eos=True))
    b = Sequence("b", [6, 7, 8], Params(max_tokens=5, ignore_eos=True))
    scheduler.add(a)
    scheduler.add(b)
    batch = scheduler.schedule()
    assert shape(batch) == [("a", 0, 5), ("b", 0, 3)]
    assert all(e.is_prefill and e.samples_token for e in batch.entries)
    assert batch.input_token_ids() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert batch.positions() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert batch.block_tables() == [[0, 1], [2]]
    assert batch.slot_mapping() == [0, 1, 2, 3, 4, 8, 9, 10]
    assert batch.query_start_locs() == [0, 5, 8]
    assert batch.context_lens() == [5, 3]
    assert batch.sample_indices() == [4, 7]
    scheduler.postprocess(batch, [11, 12])
    assert a.token_ids[-1] == 11 and b.token_ids[-1] == 12
    batch = scheduler.schedule()
    assert shape(batch) == [("a", 5, 1), ("b", 3, 1)]
    assert not any(e.is_prefill for e in batch.entries)
    assert batch.input_token_ids() == [11, 12]
    assert batch.slot_mapping() == [5, 11]     # a: block 1 offset 1; b: block 2 offset 3
    assert batch.sample_indices() == [0, 1]


def test_chunked_prefill_never_stalls_a_running_decode():
    scheduler, runner = make(max_num_seqs=2, max_num_batched_tokens=4)
    a = Sequence("a", [1, 2], Params(max_tokens=10, ignore_eos=True))
    scheduler.add(a)
    step(scheduler, runner)
    scheduler.add(Sequence("b", list(range(1, 11)), Params(max_tokens=1)))
    shapes = [shape(step(scheduler, runner)[0]) for _ in range(4)]
    assert shapes == [[("a", 2, 1), ("b", 0, 3)],
                      [("a", 3, 1), ("b", 3, 3)],
                      [("a", 4, 1), ("b", 6, 3)],
                      [("a", 5, 1), ("b", 9, 1)]]


def test_without_chunked_prefill_a_prompt_waits_for_room_in_one_step():
    def run(chunked):
        scheduler, runner = make(num_blocks=8, max_num_seqs=3, max_num_batched_tokens=16,
                                 enable_chunked_prefill=chunked, max_model_len=16)
        scheduler.add(Sequence("a", [1, 2], Params(max_tokens=2, ignore_eos=True)))
        scheduler.add(Sequence("c", [3, 4], Params(max_tokens=4, ignore_eos=True)))
        step(scheduler, runner)
        scheduler.add(Sequence("b", list(range(1, 16)), Params(max_tokens=1)))
        return [shape(step(scheduler, runner)[0]) for _ in range(2)]

    assert run(chunked=False) == [[("a", 2, 1), ("c", 2, 1)], [("c", 3, 1), ("b", 0, 15)]]
    assert run(chunked=True) == [[("a", 2, 1), ("c", 2, 1), ("b", 0, 14)], [("c", 3, 1), ("b", 14, 1)]]


def test_max_num_seqs_limits_the_batch():
    scheduler, runner = make(max_num_seqs=2)
    for name in "xyz":
        scheduler.add(Sequence(name, [1, 2, 3], Params(max_tokens=2, ignore_eos=True)))
    assert [e.seq.request_id for e in step(scheduler, runner)[0].entries] == ["x", "y"]
    batch, finished = step(scheduler, runner)
    assert [e.seq.request_id for e in batch.entries] == ["x", "y"] and len(finished) == 2
    assert [e.seq.request_id for e in step(scheduler, runner)[0].entries] == ["z"]


def test_preemption_frees_the_newest_and_recomputes_it_from_the_cache():
    scheduler, runner = make(num_blocks=4, block_size=2, max_num_seqs=2, max_num_batched_tokens=8)
    params = Params(max_tokens=4, ignore_eos=True)
    a, b = Sequence("a", [1, 2, 3], params), Sequence("b", [4, 5, 6], params)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler, runner)                          # both prefilled: all 4 blocks used
    c = Sequence("c", [7, 8, 9], params)
    scheduler.add(c)                                 # arrives before b is preempted, queues behind it
    step(scheduler, runner)                          # both decode into their second block
    batch, _ = step(scheduler, runner)               # a needs a third block: b goes
    assert shape(batch) == [("a", 4, 1)] and batch.preempted == [b]
    assert b.status is SequenceStatus.PREEMPTED and b.block_table == []
    assert scheduler.stats.num_preemptions == 1 and b.timeline.num_preemptions == 1
    batch, finished = step(scheduler, runner)        # b cannot fit until a finishes
    assert shape(batch) == [("a", 5, 1)] and finished == [a]
    batch, _ = step(scheduler, runner)               # b: 2 tokens cached, 3 recomputed
    assert shape(batch) == [("b", 2, 3)] and batch.entries[0].is_prefill
    while scheduler.has_unfinished():
        step(scheduler, runner)
    for seq in (a, b, c):
        assert seq.generated_token_ids == reference_generate(seq.prompt_token_ids, params, 8)[0]


def test_a_newer_prefill_shrinks_to_the_free_blocks_then_yields_to_an_older_decode():
    scheduler, runner = make(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=8)
    older = Sequence("b", [1, 2], Params(max_tokens=8, ignore_eos=True))
    newer = Sequence("a", list(range(1, 15)), Params(max_tokens=1))
    scheduler.add(older)
    scheduler.add(newer)
    shapes = [(shape(batch), [s.request_id for s in batch.preempted])
              for batch, _ in (step(scheduler, runner) for _ in range(4))]
    assert shapes == [([("b", 0, 2), ("a", 0, 6)], []),   # 3 blocks used, 1 free
                      ([("b", 2, 1), ("a", 6, 6)], []),   # 7 tokens wanted, 6 fit in the free block
                      ([("b", 3, 1)], []),                # no free block: a waits, holding its blocks
                      ([("b", 4, 1)], ["a"])]             # b needs a block: the newer a goes


def test_abort_frees_blocks_wherever_the_request_is():
    scheduler, runner = make(num_blocks=4, max_num_seqs=1)
    running = Sequence("r", [1, 2, 3, 4, 5], Params(max_tokens=8, ignore_eos=True))
    waiting = Sequence("w", [1, 2, 3])
    scheduler.add(running)
    scheduler.add(waiting)
    batch = scheduler.schedule()
    sampled = runner.run(batch)
    assert scheduler.block_manager.num_used_blocks == 2
    assert scheduler.abort("r") is running                   # during the forward pass
    assert scheduler.postprocess(batch, sampled) == []
    assert running.finish_reason == "abort" and scheduler.block_manager.num_used_blocks == 0
    assert scheduler.abort("w") is waiting and scheduler.num_waiting == 0
    assert scheduler.abort("unknown") is None and scheduler.abort("r") is None
    assert not scheduler.has_unfinished() and scheduler.stats.num_aborted == 2


class ScriptedRunner:
    def __init__(self, tokens):
        self.tokens = iter(tokens)

    def run(self, batch):
        return [next(self.tokens) for e in batch.entries if e.samples_token]


@pytest.mark.parametrize("params, script, expected", [
    (Params(max_tokens=10), [5, 0, 7], ([5, 0], "stop")),
    (Params(max_tokens=3, ignore_eos=True), [5, 0, 7, 8], ([5, 0, 7], "length")),
    (None, [5, 0, 7], ([5, 0], "stop")),
    (None, [9] * 20, ([9] * 5, "length")),                                     # context 8
])
def test_stop_conditions(params, script, expected):
    bm = BlockManager(num_blocks=2, block_size=4)
    scheduler = Scheduler(SchedulerConfig(), bm, eos_token_ids=(EOS,))
    seq = Sequence("a", [1, 2, 3], params)
    scheduler.add(seq)
    runner, finished = ScriptedRunner(script), []
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        finished += scheduler.postprocess(batch, runner.run(batch))
    assert finished == [seq] and (seq.generated_token_ids, seq.finish_reason) == expected
    assert bm.num_used_blocks == 0


@pytest.mark.parametrize("policy, first", [("fcfs", "cold"), ("cache_aware", "warm")])
def test_cache_aware_policy_admits_the_longest_cached_prefix_first(policy, first):
    scheduler, runner = make(max_num_seqs=1, policy=policy)
    system_prompt = list(range(1, 13))
    scheduler.add(Sequence("seed", system_prompt + [13], Params(max_tokens=1)))
    step(scheduler, runner)
    scheduler.add(Sequence("cold", [7] * 13, Params(max_tokens=1)))
    scheduler.add(Sequence("warm", system_prompt + [14], Params(max_tokens=1)))
    batch = scheduler.schedule()
    assert [e.seq.request_id for e in batch.entries] == [first]
    if first == "warm":
        assert shape(batch) == [("warm", 12, 1)] and batch.entries[0].seq.num_cached_tokens == 12


def test_timeline_and_timings_with_a_fake_clock():
    now = [0.0]
    bm = BlockManager(num_blocks=8, block_size=4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=16), bm, clock=lambda: now[0])
    runner = FakeRunner(bm)
    seed = Sequence("seed", list(range(1, 9)), Params(max_tokens=1))
    scheduler.add(seed)
    step(scheduler, runner)                           # caches 4 tokens for the next prompt
    seq = Sequence("a", list(range(1, 7)) + [40] * 15, Params(max_tokens=3, ignore_eos=True))
    now[0] = 1.0
    scheduler.add(seq)                                # 21 prompt tokens, 4 cached: chunks 16 + 1
    batch = None
    for t in (3.0, 4.0, 6.0, 7.0, 9.0, 10.0, 12.0, 13.0):
        now[0] = t
        batch = scheduler.schedule() if t in (3.0, 6.0, 9.0, 12.0) else batch
        if t in (4.0, 7.0, 10.0, 13.0):
            scheduler.postprocess(batch, runner.run(batch))
    timeline = seq.timeline
    assert (timeline.arrival, timeline.first_scheduled, timeline.finish) == (1.0, 3.0, 13.0)
    assert timeline.prefill_chunks == [(4.0, 16), (7.0, 1)]
    assert (timeline.prefill_done, timeline.first_token) == (7.0, 7.0)
    assert seq.timings() == {"queue_s": 2.0, "prefill_s": 4.0, "ttft_s": 6.0, "decode_tok_s": 2 / 6.0,
                             "prompt_tokens": 21, "cached_tokens": 4, "generated_tokens": 3,
                             "cached_tokens_device": 4, "cached_tokens_ram": 0, "cached_tokens_disk": 0,
                             "computed_prompt_tokens": 17,
                             "preemptions": 0, "draft_tokens": 0, "accepted_tokens": 0,
                             "acceptance_rate": None}


def test_user_errors_are_one_sentence():
    bm = BlockManager(num_blocks=4, block_size=4)
    with pytest.raises(UserError, match="at least the number of sequences batched together"):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(UserError, match="policy"):
        SchedulerConfig(policy="random")
    with pytest.raises(UserError, match="does not fit the KV cache"):
        Scheduler(SchedulerConfig(max_model_len=32), bm)
    with pytest.raises(UserError, match="chunked prefill"):
        Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, enable_chunked_prefill=False), bm)
    scheduler = Scheduler(SchedulerConfig(), bm)
    with pytest.raises(UserError, match="no room"):
        scheduler.add(Sequence("long", list(range(16))))
    with pytest.raises(UserError, match="empty"):
        scheduler.add(Sequence("empty", []))
    scheduler.add(Sequence("a", [1]))
    with pytest.raises(UserError, match="already"):
        scheduler.add(Sequence("a", [2]))


# --- property: any workload finishes exactly once, uncorrupted ----------------------------------

BASE = [3, 9, 1, 4, 4, 8, 2, 6, 5, 7, 3, 1]

requests = st.lists(st.tuples(st.integers(0, len(BASE)),                       # shared prefix length
                              st.lists(st.integers(1, VOCAB - 1), max_size=5),  # own tail
                              st.integers(1, 12),                               # max_tokens
                              st.booleans(),                                    # ignore_eos
                              st.integers(0, 6),                                # arrival step
                              st.none() | st.integers(0, 40)),                  # abort step
                    min_size=1, max_size=8)


@settings(max_examples=300, deadline=None)
@given(requests=requests, block_size=st.sampled_from([2, 4]), num_blocks_extra=st.integers(0, 4),
       max_num_seqs=st.integers(1, 4), budget_extra=st.integers(0, 12), chunked=st.booleans(),
       policy=st.sampled_from(["fcfs", "cache_aware"]), reserve=st.sampled_from([0, 3, 12]),
       watermark=st.sampled_from([0.0, 0.1]), num_groups=st.sampled_from([0, 1, 2]))
def test_every_request_finishes_once_with_its_solo_output(requests, block_size, num_blocks_extra,
                                                          max_num_seqs, budget_extra, chunked, policy,
                                                          reserve, watermark, num_groups):
    """num_groups > 0: the requests are the choices of that many client requests (seat shares,
    fair_share.py, preempt and reorder them); 0: each request is its own."""
    max_model_len = 24
    bm = BlockManager(max_model_len // block_size + num_blocks_extra, block_size)
    budget = max_num_seqs + budget_extra if chunked else max_model_len
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             enable_chunked_prefill=chunked, policy=policy, max_model_len=max_model_len,
                             output_reserve_tokens=reserve, watermark=watermark)
    scheduler, runner = Scheduler(config, bm, eos_token_ids=(EOS,)), FakeRunner(bm)
    seqs = [Sequence(f"r{i}", BASE[:n] + tail or [1], Params(max_tokens=m, ignore_eos=ignore),
                     group=f"g{i % num_groups}" if num_groups else "")
            for i, (n, tail, m, ignore, _, _) in enumerate(requests)]
    finished: list[Sequence] = []
    for step_index in range(500):
        for seq, (*_, arrival, abort) in zip(seqs, requests):
            if arrival == step_index:
                scheduler.add(seq)
            if abort == step_index and (seq := scheduler.abort(seq.request_id)) is not None:
                finished.append(seq)
        if not scheduler.has_unfinished() and step_index > 6:
            break
        decodes_due = [s for s in scheduler.running if not s.is_prefill]
        batch = scheduler.schedule()
        in_batch = [e.seq for e in batch.entries]
        assert batch.num_batched_tokens <= budget and len(in_batch) <= max_num_seqs
        assert len(set(map(id, in_batch))) == len(in_batch)
        assert len(scheduler.running) <= max_num_seqs
        for seq in decodes_due:                      # decodes are never starved
            assert any(seq is s for s in in_batch + batch.preempted)
        assert all(e.num_new_tokens == e.seq.num_tokens - e.start_position
                   for e in batch.entries if not e.is_prefill or not chunked)
        holders = [0] * bm.num_blocks
        for seq in scheduler.running:
            for block_id in seq.block_table:
                holders[block_id] += 1
        assert [b.ref_count for b in bm.blocks] == holders
        assert all(not s.block_table for s in scheduler.waiting)
        finished += scheduler.postprocess(batch, runner.run(batch))
    else:
        raise AssertionError("the workload did not finish")

    assert sorted(s.request_id for s in finished) == sorted(s.request_id for s in seqs)
    assert bm.num_used_blocks == 0 and all(b.ref_count == 0 for b in bm.blocks)
    for seq in seqs:
        assert seq.status is SequenceStatus.FINISHED
        expected_tokens, expected_reason = reference_generate(seq.prompt_token_ids, seq.sampling_params,
                                                              max_model_len)
        if seq.finish_reason == "abort":
            assert expected_tokens[:seq.num_generated_tokens] == seq.generated_token_ids
        else:
            assert (seq.generated_token_ids, seq.finish_reason) == (expected_tokens, expected_reason)
            t = seq.timeline
            assert t.arrival <= t.first_scheduled <= t.prefill_done <= t.first_token <= t.finish


def test_requests_sharing_a_prefix_in_flight_wait_for_its_blocks():
    """Two requests with the same 8-token system prompt arrive together: the second is not
    admitted beside the first (it would compute the shared blocks again); the step after,
    it takes both blocks from the prefix cache. An unrelated request is admitted at once."""
    scheduler, runner = make(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    shared = [21, 22, 23, 24, 25, 26, 27, 28]
    a = Sequence("a", shared + [1, 2], Params(max_tokens=3, ignore_eos=True))
    b = Sequence("b", shared + [3, 4, 5], Params(max_tokens=3, ignore_eos=True))
    c = Sequence("c", [40, 41, 42, 43, 44], Params(max_tokens=3, ignore_eos=True))
    for seq in (a, b, c):
        scheduler.add(seq)
    batch, _ = step(scheduler, runner)
    assert shape(batch) == [("a", 0, 10), ("c", 0, 5)]
    batch, _ = step(scheduler, runner)
    assert ("b", 8, 3) in shape(batch)
    assert b.timeline.num_cached_tokens == 8
    while scheduler.has_unfinished():
        step(scheduler, runner)
    assert b.generated_token_ids == reference_generate(b.prompt_token_ids, b.sampling_params, 10_000)[0]


def run_to_end(scheduler, runner, seqs):
    for seq in seqs:
        scheduler.add(seq)
    for _ in range(1000):
        if not scheduler.has_unfinished():
            return
        step(scheduler, runner)
    raise AssertionError("the workload did not finish")


@pytest.mark.parametrize("reserve", [0, 12])
def test_admission_that_reserves_queues_instead_of_preempting(reserve):
    """Six 6-token prompts, 12 tokens out each, a pool of 12 blocks of 4. Admitted greedily,
    four start at 2 blocks each and must preempt as they grow to 5 blocks (18 tokens). With
    the whole output reserved, two run at a time (2 x 5 = 10 <= 12 blocks): no preemption,
    the same outputs, each equal to the request alone."""
    scheduler, runner = make(num_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                             output_reserve_tokens=reserve)
    params = Params(max_tokens=12, ignore_eos=True)
    seqs = [Sequence(f"r{i}", [1 + i, 2, 3, 4, 5, 6 + i], params) for i in range(6)]
    run_to_end(scheduler, runner, seqs)
    for seq in seqs:
        assert seq.generated_token_ids == reference_generate(seq.prompt_token_ids, params, 10_000)[0]
    if reserve:
        assert scheduler.stats.num_preemptions == 0 and scheduler.stats.num_admissions_deferred > 0
    else:
        assert scheduler.stats.num_preemptions > 0
    assert scheduler.block_manager.num_used_blocks == 0


def test_the_watermark_keeps_free_blocks_back_but_never_blocks_an_idle_engine():
    """A pool of 10 blocks of 4 with a 30% watermark (3 blocks): a 6-token prompt takes 2, a
    second one would leave 10 - 2 - 2 = 6 >= 3 free, a third 4, a fourth 2 < 3: it waits. A
    prompt of 36 tokens (9 blocks, past the watermark) is still admitted when nothing runs."""
    scheduler, runner = make(num_blocks=10, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                             watermark=0.3)
    params = Params(max_tokens=2, ignore_eos=True)
    for i in range(4):
        scheduler.add(Sequence(f"r{i}", [1 + i, 2, 3, 4, 5, 6], params))
    batch, _ = step(scheduler, runner)
    assert [e.seq.request_id for e in batch.entries] == ["r0", "r1", "r2"]
    run_to_end(scheduler, runner, [])
    scheduler.add(Sequence("long", list(range(7, 25)) * 2, params))
    batch, _ = step(scheduler, runner)
    assert shape(batch) == [("long", 0, 36)]
    run_to_end(scheduler, runner, [])
    assert scheduler.block_manager.num_used_blocks == 0


@settings(max_examples=150, deadline=None)
@given(requests=requests, block_size=st.sampled_from([2, 4]), num_blocks_extra=st.integers(0, 6),
       max_num_seqs=st.integers(1, 3), max_bypass=st.integers(0, 3), reserve=st.sampled_from([0, 4]))
def test_cache_aware_order_lets_no_request_be_passed_more_than_the_age_bound(requests, block_size,
                                                                            num_blocks_extra, max_num_seqs,
                                                                            max_bypass, reserve):
    """Counted from outside: each time a request is admitted, every request still waiting
    that arrived before it was passed once. No request is passed more than max_bypass times,
    and every output is the request's alone."""
    max_model_len = 24
    bm = BlockManager(max_model_len // block_size + num_blocks_extra, block_size)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_seqs + 6,
                             policy="cache_aware", max_model_len=max_model_len, max_bypass=max_bypass,
                             output_reserve_tokens=reserve)
    scheduler, runner = Scheduler(config, bm, eos_token_ids=(EOS,)), FakeRunner(bm)
    seqs = [Sequence(f"r{i}", BASE[:n] + tail or [1], Params(max_tokens=m, ignore_eos=ignore))
            for i, (n, tail, m, ignore, _, _) in enumerate(requests)]
    passed = {s.request_id: 0 for s in seqs}
    for step_index in range(500):
        for seq, (*_, arrival, _) in zip(seqs, requests):
            if arrival == step_index:
                scheduler.add(seq)
        if not scheduler.has_unfinished() and step_index > 6:
            break
        waiting_before = list(scheduler.waiting)
        batch = scheduler.schedule()
        was_waiting = {id(s) for s in waiting_before}
        admitted = [e.seq for e in batch.entries if id(e.seq) in was_waiting]    # in admission order
        for i, seq in enumerate(admitted):
            admitted_so_far = {id(s) for s in admitted[:i + 1]}
            for other in waiting_before:
                if other.arrival_index < seq.arrival_index and id(other) not in admitted_so_far:
                    passed[other.request_id] += 1
        scheduler.postprocess(batch, runner.run(batch))
        assert max(passed.values()) <= max_bypass
    else:
        raise AssertionError("the workload did not finish")
    for seq in seqs:
        assert (seq.generated_token_ids, seq.finish_reason) == reference_generate(
            seq.prompt_token_ids, seq.sampling_params, max_model_len)


# --- state machine: clients come, go and vanish at any point; no block ever leaks ----------------

from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402


class ClientsComeAndGo(RuleBasedStateMachine):
    """add / step / abort (a client that vanishes: while queued, mid-prefill or decoding), with
    the reserving admission and the cache-aware order with a small age bound. After every rule
    the blocks' reference counts are exactly the running sequences' block tables; at the end,
    with everyone gone, every block is free."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(10, 2)
        config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=6, policy="cache_aware",
                                 max_model_len=16, output_reserve_tokens=4, watermark=0.1, max_bypass=2)
        self.scheduler, self.runner = Scheduler(config, self.bm, eos_token_ids=(EOS,)), FakeRunner(self.bm)
        self.num_added = 0

    @rule(prefix=st.integers(0, 8), tail=st.lists(st.integers(1, VOCAB - 1), max_size=4),
          max_tokens=st.integers(1, 8))
    def add(self, prefix, tail, max_tokens):
        self.scheduler.add(Sequence(f"r{self.num_added}", BASE[:prefix] + tail or [1],
                                    Params(max_tokens=max_tokens, ignore_eos=True)))
        self.num_added += 1

    @precondition(lambda self: self.scheduler.has_unfinished())
    @rule()
    def step(self):
        step(self.scheduler, self.runner)

    @precondition(lambda self: self.scheduler.has_unfinished())
    @rule(which=st.integers(0, 100), where=st.sampled_from(["waiting", "prefill", "any"]))
    def vanish(self, which, where):
        pool = {"waiting": self.scheduler.waiting,
                "prefill": [s for s in self.scheduler.running if s.is_prefill],
                "any": list(self.scheduler.requests.values())}[where]
        if pool:
            seq = pool[which % len(pool)]
            assert self.scheduler.abort(seq.request_id) is seq and seq.finish_reason == "abort"

    @invariant()
    def blocks_are_held_exactly_by_the_running(self):
        holders = [0] * self.bm.num_blocks
        for seq in self.scheduler.running:
            for block_id in seq.block_table:
                holders[block_id] += 1
        assert [b.ref_count for b in self.bm.blocks] == holders
        assert all(not s.block_table for s in self.scheduler.waiting)

    def teardown(self):
        for request_id in list(self.scheduler.requests):
            self.scheduler.abort(request_id)
        assert self.bm.num_used_blocks == 0


ClientsComeAndGo.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
test_clients_that_vanish_free_everything_they_held = ClientsComeAndGo.TestCase


def test_an_itl_target_sizes_the_prefill_chunk_from_the_step_cost():
    """Step cost 10 ms + 1 ms per row, a 50 ms target: 40 rows fit. With two decodes
    running, a long prompt gets 38 tokens a step; with none, the whole budget of 64. The plan
    is on the batch: cost(40) = 50 ms."""
    cost = lambda d, p, a: 0.010 + 0.001 * (d + p)   # noqa: E731
    bm = BlockManager(64, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, itl_target_s=0.050), bm,
                          eos_token_ids=(EOS,), step_cost=cost)
    runner = FakeRunner(bm)
    long_prompt = [5, 6, 7, 8] * 25
    scheduler.add(Sequence("long", long_prompt, Params(max_tokens=2, ignore_eos=True)))
    batch, _ = step(scheduler, runner)
    assert shape(batch) == [("long", 0, 64)]           # no decodes: the whole budget
    for name in "ab":
        scheduler.add(Sequence(name, [1, 2, 3], Params(max_tokens=20, ignore_eos=True)))
    batch, _ = step(scheduler, runner)                 # "long" ends its prompt; a, b are admitted
    assert shape(batch) == [("long", 64, 36), ("a", 0, 3), ("b", 0, 3)]
    scheduler.abort("long")
    scheduler.add(Sequence("next", [9, 10, 11, 12] * 20, Params(max_tokens=2, ignore_eos=True)))
    batch, _ = step(scheduler, runner)
    assert shape(batch) == [("a", 3, 1), ("b", 3, 1), ("next", 0, 38)]
    assert batch.planned_s == pytest.approx(0.050)
    with pytest.raises(UserError, match="positive"):
        SchedulerConfig(itl_target_s=0.0)


def test_an_itl_target_prices_prompt_tokens_on_their_context():
    """Under a cost law where a prompt token's price grows with the keys it attends, each step
    beside two decodes carries exactly the most prompt tokens a brute-force search finds within
    the target (at least one block), so chunks shrink as the prompt's context grows; the plan
    on the batch is the law's price of the batch as composed."""
    from localrun.engine.step_cost import attended_keys
    cost = lambda d, p, a: 0.010 + 0.001 * d + 0.0004 * p + 2e-6 * a   # noqa: E731
    target, limit = 0.030, 64
    bm = BlockManager(256, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=limit, itl_target_s=target), bm,
                          eos_token_ids=(EOS,), step_cost=cost)
    runner = FakeRunner(bm)
    for name in "ab":
        scheduler.add(Sequence(name, [1, 2, 3], Params(max_tokens=200, ignore_eos=True)))
    step(scheduler, runner)                                  # a and b prefill (no decodes yet)
    scheduler.add(Sequence("long", [5, 6, 7, 8] * 100, Params(max_tokens=2, ignore_eos=True)))
    step(scheduler, runner)                                  # admitted beside the two decodes
    chunks, start = [], scheduler.running[-1].num_computed_tokens
    while scheduler.running[-1].request_id == "long" and scheduler.running[-1].is_prefill:
        fitting = [p for p in range(4, limit - 2 + 1) if cost(2, p, attended_keys(start, p)) <= target]
        want = max(fitting, default=4)
        batch, _ = step(scheduler, runner)
        assert shape(batch)[-1] == ("long", start, min(want, 400 - start)), (start, want)
        assert batch.planned_s == pytest.approx(cost(*batch.cost_shape()))
        chunks.append(shape(batch)[-1][2])
        start += chunks[-1]
    assert chunks[0] > chunks[-2] >= 4, chunks               # later chunks sit on more context
