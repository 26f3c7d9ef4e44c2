"""The engine calibration's timing side (localrun/calibrate_engine.py): each engine step is timed
and sorted into prompt tokens and decode rows as the engine ran them; the fastest *quiet* repeat
counts; and the whole calibration runs end to end on a tiny model."""
import math
from dataclasses import replace

import pytest

from layerplan import calibrate, quiet
from layerplan.devices import Device, Machine
from localrun import calibrate_engine
from localrun.calibrate_engine import (Rounds, decode_step_seconds, measure_engine, prefill_seconds,
                                       synthetic_prompt, timed_steps)


def test_steps_are_sorted_into_prompt_tokens_and_decode_rows(tiny_gguf):
    import localrun
    from localrun.sampling_params import SamplingParams

    llm = localrun.LLM(tiny_gguf("Q4_0"), n_ctx=64, n_parallel=2, n_threads=1, kv_watermark=0.0)
    n_vocab = llm.config.n_vocab
    prompts = [synthetic_prompt(20, n_vocab, 1), synthetic_prompt(11, n_vocab, 2)]
    steps, seqs = timed_steps(llm.engine, prompts, SamplingParams(max_tokens=5, ignore_eos=True, seed=0))
    # both prompts in the first step, then four steps in which both decode (the first token came with the prompt)
    assert [(s.prompt_tokens, s.decode_rows) for s in steps] == [(31, 0)] + [(0, 2)] * 4
    assert all(s.seconds > 0 and s.page_faults >= 0 for s in steps)
    assert [s.num_generated_tokens for s in seqs] == [5, 5]
    assert prefill_seconds(steps) == (31, steps[0].seconds)
    # the median of the four decode steps: the mean of the middle two
    assert decode_step_seconds(steps, 2) == pytest.approx(sum(sorted(s.seconds for s in steps[1:])[1:3]) / 2)
    assert decode_step_seconds(steps, 1) is None


def test_prompts_of_different_keys_share_no_first_block():
    a, b = synthetic_prompt(64, 49152, 1), synthetic_prompt(64, 49152, 2)
    assert a[:16] != b[:16] and a == synthetic_prompt(64, 49152, 1) and max(a) < 49152


class _FakeMeter:
    """quiet.OtherCPU stand-in: each meter reports the next figure of `cores`."""
    cores_seen: list = []

    def __init__(self):
        self.value = _FakeMeter.cores_seen.pop(0)

    def cores(self):
        return self.value


@pytest.fixture
def fake_quiet(monkeypatch):
    monkeypatch.setattr(quiet, "wait_until_quiet", lambda *a, **k: 0.0)
    monkeypatch.setattr(quiet, "OtherCPU", _FakeMeter)
    return _FakeMeter


def test_the_fastest_quiet_repeat_counts(fake_quiet):
    fake_quiet.cores_seen = [0.0, 0.9, 0.1, 0.0]
    values = iter([(3.0, 5.0), (1.0, 1.0), (2.0, 6.0), (9.0, 9.0)])
    # the 1.0 came while another process used 0.9 cores: not trusted; two quiet repeats end it
    assert Rounds(lambda i: next(values), repeats=2).result() == ((2.0, 5.0), 0.1, True)


def test_a_typical_timing_is_the_median_of_the_quiet_repeats(fake_quiet):
    fake_quiet.cores_seen = [0.0, 0.9, 0.0, 0.1]
    values = iter([(3.0,), (0.5,), (1.0,), (2.0,)])
    assert Rounds(lambda i: next(values), repeats=3, typical=True).result() == ((2.0,), 0.1, True)


def test_without_a_quiet_repeat_the_fastest_counts_and_says_so(fake_quiet):
    fake_quiet.cores_seen = [0.5, 0.7]
    values = iter([(3.0,), (2.0,)])
    assert Rounds(lambda i: next(values), repeats=1).result() == ((2.0,), 0.7, False)


def test_measure_engine_end_to_end_on_a_tiny_model(tiny_gguf, monkeypatch, capsys):
    monkeypatch.setattr(quiet, "wait_until_quiet", lambda *a, **k: 0.0)
    # the timings are taken in a new process (main); here in this one, through main's JSON line
    def in_this_process(path, threads):
        capsys.readouterr()
        calibrate_engine.main([str(path), str(threads)])
        return calibrate_engine.read_timings(capsys.readouterr().out.strip().splitlines()[-1])
    monkeypatch.setattr(calibrate_engine, "measure_timings_in_new_process", in_this_process)
    monkeypatch.setattr(calibrate_engine, "DECODE_REPEATS", 1)
    monkeypatch.setattr(calibrate_engine, "PREFILL_REPEATS", 1)
    monkeypatch.setattr(calibrate_engine, "DECODE_STEPS", 6)
    monkeypatch.setattr(calibrate_engine, "MIDDLE_FILL", 96)   # the tiny model's 256 tokens hold no 512
    base = calibrate.Calibration(fingerprint="x", host_bandwidth=20e9, host_flops=1e11, host_matmul_overhead_s=300e-6,
                                 other_cpu=0.0)    # torch's matvec overhead, as the micro-benchmarks found it on a Zen 3
    model = tiny_gguf("Q4_0", n_layers=3)
    tuned = measure_engine(model, base, threads=1, attempts=1)   # a tiny model's timings are all noise: no retake
    assert tuned.backend == "engine" and "3 layers" in tuned.engine_model and "1 threads" in tuned.engine_model
    assert tuned.engine_key == calibrate.engine_key(model)      # saved as this model's own (test_plan_calibration)
    assert " ms at 99 cached, " in tuned.engine_model     # the middle fill (96 + half the 6 decode steps)
    assert 0 < tuned.host_flops < 1e16
    for figure in (tuned.host_decode_flops, tuned.host_kv_bandwidth, tuned.host_attention_flops):
        assert figure == 0.0 or 0 < figure < 1e16      # 0: too small to see on a tiny model, the default kept
    assert tuned.host_layer_overhead_s >= 0 and tuned.host_step_overhead_s >= 0
    assert tuned.fingerprint == "x"
    assert tuned.host_bandwidth == 20e9     # the micro-benchmarks' figure stays: a tiny model's steps are all overhead
    host = Device("CPU", "cpu", 1 << 34, 1 << 34, memory_bandwidth=1e10, compute_flops=1e10)
    machine = calibrate.apply(Machine(gpus=(), host=host), tuned)
    assert machine.host.decode_flops == tuned.host_decode_flops and machine.host.attention_flops == tuned.host_attention_flops
    assert machine.host.unpack_bandwidth == (tuned.host_unpack_bandwidth or 0.0)
    # the quantized caches are timed on engines of their own, their decode attention rates carried over
    assert "int8 KV: " in tuned.engine_model and "fp8 KV: " in tuned.engine_model
    assert set(tuned.host_kv_decode_flops or {}) <= {"q8_0", "fp8"}
    assert machine.host.kv_decode_flops == tuple((name, *rates) for name, rates
                                                 in sorted((tuned.host_kv_decode_flops or {}).items()))
    # the engine's calls' fixed costs are in its per-layer and per-step figures, not torch's matvec overhead
    assert tuned.host_matmul_overhead_s == 0.0 and machine.host.matmul_overhead_s == 0.0


def test_a_calibration_across_a_change_of_the_machines_speed_is_suspect(tiny_gguf, monkeypatch, capsys):
    """The first timing's later rounds moved from its first by more than DRIFT_LIMIT (other tenants
    of a virtual machine's host: our own CPU shows no other work): the calibration is suspect, is
    not saved, and says why."""
    monkeypatch.setattr(quiet, "wait_until_quiet", lambda *a, **k: 0.0)
    monkeypatch.setattr(calibrate_engine, "DECODE_REPEATS", 1)
    monkeypatch.setattr(calibrate_engine, "PREFILL_REPEATS", 1)
    monkeypatch.setattr(calibrate_engine, "DECODE_STEPS", 6)
    capsys.readouterr()
    calibrate_engine.main([str(tiny_gguf("Q4_0", n_layers=3)), "1"])
    timings, kv_type, other_cpu, all_quiet, drift = calibrate_engine.read_timings(
        capsys.readouterr().out.strip().splitlines()[-1])
    assert drift >= 0.0
    base = calibrate.Calibration(fingerprint="x", host_bandwidth=20e9, host_flops=1e11, host_matmul_overhead_s=0.0,
                                 other_cpu=0.0)
    monkeypatch.setattr(calibrate, "MISFIT_LIMIT", math.inf)    # a tiny model's timings: the drift alone here
    for moved, suspect in ((0.05, False), (0.3, True)):
        monkeypatch.setattr(calibrate_engine, "measure_timings_in_new_process",
                            lambda path, threads: (timings, kv_type, 0.0, True, moved))
        tuned = measure_engine(tiny_gguf("Q4_0", n_layers=3), base, threads=1)
        assert (tuned.suspect, tuned.drift, tuned.engine_reference_s) == (suspect, moved, timings.decode_short_s)
        assert tuned.engine_reference_long_s == timings.decode_long_s
        assert f"moved from its first by {moved:.1%}" in tuned.engine_model
    assert "the machine's speed moved by 30%" in tuned.suspect_reason
    assert calibrate.save(tuned) is None
    assert calibrate.Calibration(fingerprint="x", host_bandwidth=1, host_flops=1, host_matmul_overhead_s=0,
                                 suspect=True).suspect_reason.startswith("taken under load")
    # a later run takes the same timing again (benchmarks/plan_accuracy.py: how the machine moved since)
    short_s, long_s = calibrate_engine.reference_step_seconds(tiny_gguf("Q4_0", n_layers=3), 1)
    assert 0 < short_s < 10 and 0 < long_s < 10
    # a timing the others contradict (the shallow stack slower than the whole: a slower phase of the
    # host met it) leaves the fitted model far from it: suspect, not saved, and it says why
    monkeypatch.setattr(calibrate, "MISFIT_LIMIT", 0.15)
    slow = replace(timings, decode_short_shallow_s=3 * timings.decode_short_s)
    monkeypatch.setattr(calibrate_engine, "measure_timings_in_new_process",
                        lambda path, threads: (slow, kv_type, 0.0, True, 0.0))
    tuned = measure_engine(tiny_gguf("Q4_0", n_layers=3), base, threads=1)
    assert tuned.suspect and tuned.misfit > 0.15 and calibrate.save(tuned) is None
    assert "timings is" in tuned.suspect_reason and "off what the others say" in tuned.suspect_reason


def test_a_calibration_across_which_the_host_moved_is_taken_again(tiny_gguf, monkeypatch, capsys, tmp_path):
    """Drift past DRIFT_LIMIT: measured again, up to ENGINE_ATTEMPTS in all; the first steady one
    is kept (and says which attempt it was), or, when none is steady, the least moved, still
    suspect. Other work on the CPU is not retaken: it would still be there."""
    monkeypatch.setattr(quiet, "wait_until_quiet", lambda *a, **k: 0.0)
    monkeypatch.setattr(calibrate_engine, "DECODE_REPEATS", 1)
    monkeypatch.setattr(calibrate_engine, "PREFILL_REPEATS", 1)
    monkeypatch.setattr(calibrate_engine, "DECODE_STEPS", 6)
    capsys.readouterr()
    model = tiny_gguf("Q4_0", n_layers=3)
    calibrate_engine.main([str(model), "1"])
    timings, kv_type, _, _, _ = calibrate_engine.read_timings(capsys.readouterr().out.strip().splitlines()[-1])
    monkeypatch.setattr(calibrate, "MISFIT_LIMIT", math.inf)    # the drift alone decides here
    base = calibrate.Calibration(fingerprint="x", host_bandwidth=20e9, host_flops=1e11, host_matmul_overhead_s=0.0,
                                 other_cpu=0.0)

    def measured(*runs):    # (drift, all quiet) of each successive calibration
        calls = iter(runs)
        taken = []
        def take(path, threads):
            drift, all_quiet = next(calls)
            taken.append(drift)
            return timings, kv_type, 0.0, all_quiet, drift
        monkeypatch.setattr(calibrate_engine, "measure_timings_in_new_process", take)
        return taken

    heard = []
    taken = measured((0.25, True), (0.04, True), (0.5, True))
    tuned = measure_engine(model, base, threads=1, attempts=3, say=heard.append)
    assert taken == [0.25, 0.04] and not tuned.suspect and tuned.drift == 0.04
    assert "attempt 2 of 2" in tuned.engine_model and "1: drift 25.0%" in tuned.engine_model
    assert heard == ["engine calibration 1 of 3: the machine's speed moved by 25% while measuring; measuring again"]
    assert calibrate.save(tuned, cache_dir=tmp_path) is not None

    taken = measured((0.3, True), (0.2, True), (0.4, True))
    tuned = measure_engine(model, base, threads=1, attempts=3)
    assert taken == [0.3, 0.2, 0.4] and tuned.suspect and tuned.drift == 0.2 and "attempt 2 of 3" in tuned.engine_model
    assert calibrate.save(tuned, cache_dir=tmp_path / "suspect") is None

    taken = measured((0.3, False), (0.0, True))      # other work on the CPU: suspect, not retaken
    tuned = measure_engine(model, base, threads=1, attempts=3)
    assert taken == [0.3] and tuned.suspect and "attempt" not in tuned.engine_model

    taken = measured((0.02, True), (0.0, True))      # steady the first time: measured once
    tuned = measure_engine(model, base, threads=1)
    assert taken == [0.02] and not tuned.suspect


def test_a_plan_on_a_suspect_calibration_says_why_in_its_source():
    host = Device("CPU", "cpu", 1 << 34, 1 << 34, memory_bandwidth=1e10, compute_flops=1e10)
    moved = calibrate.Calibration(fingerprint="x", host_bandwidth=2e10, host_flops=1e11, host_matmul_overhead_s=0.0,
                                  suspect=True, drift=0.28)
    assert calibrate.apply(Machine(gpus=(), host=host), moved).host.source.endswith(
        "suspect: the machine's speed moved by 28% while measuring")
    loaded = calibrate.apply(Machine(gpus=(), host=host), calibrate.Calibration(
        fingerprint="x", host_bandwidth=2e10, host_flops=1e11, host_matmul_overhead_s=0.0, suspect=True))
    assert loaded.host.source.endswith("suspect: taken under load")


def test_rounds_taken_between_other_work_give_what_rounds_in_a_row_give(fake_quiet):
    fake_quiet.cores_seen = [0.0, 0.9, 0.1, 0.0]
    values = iter([(3.0, 5.0), (1.0, 1.0), (2.0, 6.0), (9.0, 9.0)])
    rounds = calibrate_engine.Rounds(lambda i: next(values), repeats=2)
    rounds.round()
    assert not rounds.done()
    rounds.round()
    rounds.round()           # the second quiet call: done, and later rounds take nothing
    rounds.round()
    assert rounds.done() and len(rounds.samples) == 3
    assert rounds.result() == ((2.0, 5.0), 0.1, True)


def test_a_timing_moved_by_its_first_quiet_rounds_against_its_last(fake_quiet):
    fake_quiet.cores_seen = [0.0, 0.9, 0.0, 0.0, 0.0, 0.0]
    values = iter([(10.0, 1.0), (50.0, 1.0), (11.0, 1.0), (30.0, 4.0), (12.5, 2.0), (13.0, 2.0)])
    rounds = calibrate_engine.Rounds(lambda i: next(values), repeats=5, typical=True)
    rounds.round()
    assert rounds.moved() == 0.0       # one round: nothing to compare
    assert rounds.result() == ((12.5, 2.0), 0.0, True)   # the busy round left out
    # quiet rounds 10, 11, 30, 12.5, 13: the first two's median (10.5) against the last two's (12.75)
    assert rounds.moved(0) == 12.75 / 10.5 - 1 and rounds.moved(1) == 1.0


def test_decode_rounds_after_the_first_take_their_prompts_from_the_prefix_cache(tiny_gguf, monkeypatch):
    monkeypatch.setattr(quiet, "wait_until_quiet", lambda *a, **k: 0.0)
    monkeypatch.setattr(calibrate_engine, "DECODE_STEPS", 6)
    computed = []      # prompt tokens computed by each run

    def logged(self, prompts, max_tokens=6):
        steps = run(self, prompts, max_tokens)
        computed.append(sum(s.prompt_tokens for s in steps))
        return steps
    run = calibrate_engine._Engine.run
    monkeypatch.setattr(calibrate_engine._Engine, "run", logged)
    for n_seqs in (1, 2):
        engine = calibrate_engine._Engine(tiny_gguf("Q4_0", n_layers=3), None, 96 + 6 + 16, n_seqs, 1)
        rounds = engine.decode(n_seqs, 32, 96)
        computed.clear()
        rounds.round()
        first = computed[:]
        rounds.round()
        rounds.round()
        # the first round computes the long prompts past the short ones' blocks; later rounds at
        # most a block of each prompt (the engine recomputes a fully cached prompt's last token)
        assert first == [32 * n_seqs, (96 - 32) * n_seqs]
        assert all(0 < c <= 16 * n_seqs for c in computed[2:]), computed
        assert all(v > 0 for v in rounds.result()[0])


def test_a_finished_timing_lets_its_engine_go(fake_quiet):
    """The low-memory path builds one engine at a time and deletes it after its rounds: the
    Rounds kept for the result must not hold it alive through `take`."""
    import gc
    import weakref

    class Engine:
        def step(self, i):
            return (1.0,)
    fake_quiet.cores_seen = [0.0, 0.0]
    engine = Engine()
    rounds = calibrate_engine.Rounds(engine.step, repeats=2)
    gone = weakref.ref(engine)
    del engine
    assert rounds.result() == ((1.0,), 0.0, True)
    gc.collect()
    assert gone() is None and rounds.result() == ((1.0,), 0.0, True) and rounds.moved() == 0.0


def _rounds_taken(tiny_gguf, monkeypatch, room: bool) -> str:
    """The order in which measure_timings took its timings' rounds on a tiny model: one letter per
    round, a letter per timing in the order of their first rounds (A the 4-sequence decode, B the
    prompt timings)."""
    monkeypatch.setattr(quiet, "wait_until_quiet", lambda *a, **k: 0.0)
    monkeypatch.setattr(quiet.OtherCPU, "cores", lambda self: 0.0)    # every round quiet
    monkeypatch.setattr(calibrate_engine, "DECODE_REPEATS", 2)
    monkeypatch.setattr(calibrate_engine, "PREFILL_REPEATS", 3)
    monkeypatch.setattr(calibrate_engine, "DECODE_STEPS", 6)
    monkeypatch.setattr(calibrate_engine, "_room_for", lambda n_engines, engine_bytes: room)
    order, letters = [], {}
    take_round = calibrate_engine.Rounds.round

    def logged_round(self):
        taken = len(self.samples)
        take_round(self)
        if len(self.samples) > taken:
            order.append(letters.setdefault(id(self), "ABCDEFGHIJ"[len(letters)]))
    monkeypatch.setattr(calibrate_engine.Rounds, "round", logged_round)
    calibrate_engine.measure_timings(tiny_gguf("Q4_0", n_layers=3), 1)
    return "".join(order)


def test_every_timing_is_spread_over_the_calibration(tiny_gguf, monkeypatch):
    rounds = _rounds_taken(tiny_gguf, monkeypatch, room=True)
    # the 4-sequence decode and the prompt timings, one-sequence decodes shallow and whole, and a
    # sequence and a batch over each quantized cache: each timing's rounds one after all the others'
    timings = "ABCDEFGH"
    assert rounds == timings * 2 + "B"


def test_without_memory_for_every_engine_they_are_timed_one_at_a_time(tiny_gguf, monkeypatch):
    rounds = _rounds_taken(tiny_gguf, monkeypatch, room=False)
    assert rounds == "AA" + "BBB" + "CC" + "DD" + "EE" + "FF" + "GG" + "HH"
