"""Seats shared between requests (engine/fair_share.py): one request's n choices take every
seat when alone, give one up to a request that arrives, and every sequence still finishes
with the tokens it would have produced alone (hand-computed steps and the scheduler's fake
model)."""
from test_scheduler import Params, make, reference_generate, shape, step

from localrun.engine.fair_share import seat_share, seat_victims
from localrun.engine.sequence import Sequence, SequenceStatus


def choices(name: str, n: int, prompt, max_tokens: int) -> list[Sequence]:
    return [Sequence(f"{name}-{i}", prompt, Params(max_tokens=max_tokens, ignore_eos=True), group=name)
            for i in range(n)]


def test_a_request_alone_takes_every_seat():
    scheduler, runner = make(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    big = choices("big", 4, [1, 2, 3], 8)
    for seq in big:
        scheduler.add(seq)
    batch, _ = step(scheduler, runner)
    assert [e.seq for e in batch.entries] == big and not batch.preempted


def test_a_newcomer_gets_a_seat_from_the_request_holding_them_all():
    """4 seats, a request with 4 choices decoding; a one-choice request arrives: the newest
    choice gives up its seat in the next step and the newcomer is admitted in that same step.
    Shares are then 2 each: the big request keeps its 3 (nobody below share waits), and the
    preempted choice resumes when the newcomer is done, with its solo output."""
    scheduler, runner = make(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    big = choices("big", 4, [1, 2, 3], 12)
    for seq in big:
        scheduler.add(seq)
    step(scheduler, runner)
    step(scheduler, runner)
    small = Sequence("small", [5, 6, 7, 8, 9], Params(max_tokens=3, ignore_eos=True))
    scheduler.add(small)
    batch, _ = step(scheduler, runner)
    assert batch.preempted == [big[3]] and big[3].status is SequenceStatus.PREEMPTED
    assert shape(batch) == [("big-0", 4, 1), ("big-1", 4, 1), ("big-2", 4, 1), ("small", 0, 5)]
    for _ in range(2):       # the newcomer runs to its end beside three of the four
        batch, _ = step(scheduler, runner)
        assert not batch.preempted and [e.seq.request_id for e in batch.entries] == [
            "big-0", "big-1", "big-2", "small"]
    assert small.is_finished
    batch, _ = step(scheduler, runner)
    assert "big-3" in [e.seq.request_id for e in batch.entries]
    while scheduler.has_unfinished():
        step(scheduler, runner)
    for seq in big + [small]:
        assert seq.generated_token_ids == reference_generate(seq.prompt_token_ids, seq.sampling_params, 10_000)[0]


def test_waiting_requests_below_their_share_are_admitted_before_more_choices():
    """A request's fifth choice waits behind a later one-choice request (both need a seat; the
    one-choice request holds none, the big one holds 3 of 4 when a seat frees)."""
    scheduler, runner = make(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    big = [Sequence(f"big-{i}", [1, 2, 3], Params(max_tokens=1 if i == 0 else 2, ignore_eos=True), group="big")
           for i in range(5)]
    for seq in big:
        scheduler.add(seq)
    small = Sequence("small", [5, 6], Params(max_tokens=2, ignore_eos=True))
    step(scheduler, runner)                 # big-0..3 prefill; big-0 ends (one token)
    scheduler.add(small)
    batch, _ = step(scheduler, runner)
    assert ("small", 0, 2) in shape(batch) and "big-4" not in [e.seq.request_id for e in batch.entries]


def test_victims_come_from_the_request_furthest_above_its_share():
    seqs = choices("a", 5, [1], 4) + choices("b", 3, [1], 4)
    for i, seq in enumerate(seqs):
        seq.arrival_index = i
    waiting = [Sequence("c", [1], Params()), Sequence("d", [1], Params())]
    assert seat_share(8, seqs, waiting) == 2
    victims = seat_victims(seqs, waiting, max_num_seqs=8)
    assert [v.request_id for v in victims] == ["a-4", "a-3"]       # a holds 5, b 3: a first, twice
    assert seat_victims(seqs[:7], waiting, max_num_seqs=8) == []   # a free seat: nobody yields
    assert seat_victims(seqs, [], max_num_seqs=8) == []


def test_no_victim_when_every_holder_is_within_its_share():
    seqs = [Sequence(f"r{i}", [1], Params()) for i in range(4)]
    assert seat_victims(seqs, [Sequence("late", [1], Params())], max_num_seqs=4) == []


def test_group_defaults_to_the_request_id():
    assert Sequence("x", [1], Params()).group == "x"
    assert Sequence("x", [1], Params(), group="g").group == "g"
