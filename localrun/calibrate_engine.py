"""Calibrate layerplan's speed model with localrun's engine itself (torch side of `--measure`).

layerplan's micro-benchmarks time matrix-vector products; the engine's real work is more: fused
matmuls through localrun's in-place kernels (decode rows one at a time in integer dot products,
prompt chunks through a GEMM on weights unpacked once per step), norms, RoPE, attention over the
paged cache, sampling, and the Python around ~240 calls per step. So this builds the model of a
GGUF file the way the engine builds it (`localrun.LLM`, at the thread count it will run with) and
times the engine's own steps (`engine.step()`, one by one):

- decode steps of one sequence at a short cache fill, through the model's first layers (and its
  head) and through all of them, and at a middle, a long and a longer fill (what the CPU's caches
  keep of the KV cache between steps, and the bandwidth past them), on engines built for one
  sequence;
- decode steps of BATCH sequences at the short fill, the middle one and the long one;
- decode steps of one sequence and of BATCH sequences, at the short and the long fill, over each
  of OTHER_KV_TYPES (an int8 or fp8 cache is half float16's bytes, but the kernel widens and
  scales each value: on 2 Zen 3 cores one sequence's decode steps at 2048 cached tokens were as
  slow over int8 as over float16);
- the single prompt step of prompts of several sizes from an empty cache, of ATTENTION_TOKENS
  tokens as BATCH prompts, and of ATTENTION_TOKENS tokens after as many cached ones (a
  prefix-cache hit): a fixed cost per step, a cost per token, and attention (causal from an
  empty cache; after cached tokens, those unmasked and the chunk's own causal).

layerplan.engine_fit finds the host figures (per-layer and per-step overhead, decode and prompt
flop/s, the unpacking of weights per prompt step, attention's bandwidth and flop/s) that make the
speed model reproduce these timings.

Timings that meet other work describe that moment, not the machine: each is taken several times
(DECODE_REPEATS, PREFILL_REPEATS), each after waiting (a bounded time) for other processes to leave
the CPU, with the cores they used meanwhile recorded (layerplan.quiet); a timing without a quiet
repeat makes the calibration suspect. A decode timing is the median of its steps, so one late
step (a garbage collection) does not move it; the decode timings of one engine are taken in turn
within each round (short fill, middle, long, longer). Every engine is kept (where memory allows)
and every timing taken in rounds, one round of each and then the next, so that each spans the
calibration's minutes, and a timing is the median of its quiet rounds: a VM's host moves its
speed in phases of tens of seconds to minutes (the fastest of each 10 s of a fixed matmul 1.37x
apart over 5 minutes, of each 60 s 1.13x), and repeats within seconds measured one phase. The
median, not the fastest: the fastest of six rounds is the calibration's luckiest moment, and a
benchmark minutes later in a slower phase read 0.85-0.88 of it where the median read within
0.9-1.1 in 5 of 6 runs (docs/layerplan.md, 2026-12-05). The first timing's first half of rounds
against its second says how far the host moved across the calibration; one that moved by more than
layerplan.calibrate.DRIFT_LIMIT is suspect, as is one whose timings the fitted speed model misses
by more than MISFIT_LIMIT (a slower phase of the host that met some timings and not others). A
prompt step also varies by itself, with the fresh pages the allocator takes for the unpacked
weights (once up to a third of a step, docs/measurements.md; now 6k-250k page faults a pass of
512-8192 prompt tokens), which is the engine's own cost. A warm-up runs first in every engine, so
first-touch costs (weights paged in, kernels set up) are not timed.
"""
from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass, replace

FUSED_MATMULS_PER_LAYER = 4   # localrun's llama block: wqkv, wo, w13 (gate|up), w2
SHORT_FILL, LONG_FILL, LONGER_FILL = 32, 2048, 4096   # prompt tokens before the timed decode steps (within the
                                                      # trained context); the longer one on one sequence only
MIDDLE_FILL = 512             # one sequence only: with the long and longer fills, a least-squares fit of the KV
                              # the CPU's caches hold and the bandwidth past them (layerplan.engine_fit._fit_kv)
BATCH = 4                     # sequences in the batched decode timings
OTHER_KV_TYPES = ("int8", "fp8")  # the engine's quantized caches, timed besides the default one
PROMPT_SIZES = (128, 384, 1024, 1536)   # prompts whose single prefill step is timed (within a short context)
ATTENTION_TOKENS = 1024       # prompt tokens of the two attention timings
DECODE_STEPS = 24             # tokens generated per decode timing
DECODE_REPEATS = 6            # quiet rounds per timing, spread over the calibration; their median counts
PREFILL_REPEATS = 6
QUIET_WAIT_S = 20.0           # the longest one repeat waits for other processes to leave the CPU
ENGINE_ATTEMPTS = 3           # engine calibrations taken at most while the host's speed moves across them


def engine_profile(model_path):
    """The file's profile as localrun's engine runs it: weights as stored (its kernels read the
    file's blocks in place), q/k/v and gate/up fused into 4 matmul calls per layer."""
    import layerplan
    profile = layerplan.profile_gguf(model_path)
    return replace(profile, layers=tuple(replace(layer, n_matmuls=FUSED_MATMULS_PER_LAYER) for layer in profile.layers))


_request_ids = itertools.count()


@dataclass(frozen=True)
class StepTime:
    prompt_tokens: int    # prompt tokens the step computed
    decode_rows: int      # sequences that decoded a token in it
    seconds: float        # wall time of engine.step()
    page_faults: int = 0  # minor page faults of this process during it (fresh pages the allocator took from the OS)


def timed_steps(engine, prompts: list[list[int]], params) -> tuple[list[StepTime], list]:
    """Run `prompts` (token ids) to the end through engine.step(), timing each step.
    Returns the steps and the engine's Sequences (their timings() hold the request view)."""
    seqs = [engine.add_request(f"timed-{next(_request_ids)}", ids, params) for ids in prompts]
    steps = []
    while engine.has_unfinished():
        chunks = [len(s.timeline.prefill_chunks) for s in seqs]
        generated = [s.num_generated_tokens for s in seqs]
        faults = _minor_faults()
        start = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
        prompt = sum(n for s, c in zip(seqs, chunks) for _, n in s.timeline.prefill_chunks[c:])
        decode = sum(1 for s, g in zip(seqs, generated) if g >= 1 and s.num_generated_tokens > g)
        steps.append(StepTime(prompt, decode, seconds, _minor_faults() - faults))
    return steps, seqs


def _minor_faults() -> int:
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    except (ImportError, OSError):
        return 0


def decode_step_seconds(steps: list[StepTime], rows: int) -> float | None:
    """Median seconds of the steps that only decoded, `rows` sequences each (None: there were none)."""
    times = [s.seconds for s in steps if s.prompt_tokens == 0 and s.decode_rows == rows]
    return statistics.median(times) if times else None


def prefill_seconds(steps: list[StepTime]) -> tuple[int, float]:
    """(prompt tokens, seconds) of the steps that computed prompt tokens (decodes riding along included)."""
    prompt = [s for s in steps if s.prompt_tokens]
    return sum(s.prompt_tokens for s in prompt), sum(s.seconds for s in prompt)


def synthetic_prompt(n_tokens: int, n_vocab: int, key: int) -> list[int]:
    """Token ids that no other key's prompt shares a first block with (no prefix-cache hit)."""
    return [(7919 * (key + 1) + 31 * i + i * i) % n_vocab for i in range(n_tokens)]


class Rounds:
    """A timing taken in rounds: take(i) -> a tuple of seconds, called by round() after waiting
    for quiet each time, until `repeats` quiet calls or 2 * repeats calls. result() takes the
    rounds still missing and gives (values, the most cores other processes used during the
    rounds they came from, whether those were all quiet): each value the fastest of its quiet
    calls (typical: their median), or without any quiet call the fastest (median) of all. Rounds
    taken between other timings spread the timing over the calibration's minutes, so that it is
    the host's speed and not one phase of it (docs/layerplan.md, 2026-12-04 night and 12-05)."""

    def __init__(self, take, repeats: int, wait_s: float = QUIET_WAIT_S, typical: bool = False):
        self.take, self.repeats, self.wait_s, self.typical = take, repeats, wait_s, typical
        self.samples = []    # (values, others' cores, quiet) of each call

    def done(self) -> bool:
        quiet_calls = sum(ok for _, _, ok in self.samples)
        return quiet_calls >= self.repeats or len(self.samples) >= 2 * self.repeats

    def round(self) -> None:
        from layerplan import quiet

        if self.done():
            return
        quiet.wait_until_quiet(self.wait_s, sample_s=0.3)
        meter = quiet.OtherCPU()
        values = self.take(len(self.samples))
        cores = meter.cores()
        self.samples.append((values, cores, cores is None or cores <= quiet.QUIET_CORES))

    def result(self) -> tuple[tuple[float, ...], float | None, bool]:
        while not self.done():
            self.round()
        self.take = None     # done: what take holds (an engine) can go
        pool = [s for s in self.samples if s[2]] or self.samples
        pick = statistics.median if self.typical else min
        values = tuple(pick(s[0][k] for s in pool) for k in range(len(pool[0][0])))
        others = [s[1] for s in pool if s[1] is not None]
        return values, max(others) if others else None, all(s[2] for s in pool)

    def moved(self, k: int = 0) -> float:
        """How far value k moved from the first half of the rounds that count to the second: the
        slower of the two halves' medians over the faster, less one (0.0 with one round). A move
        of the host's speed that lasted, not one round that met a short phase."""
        pool = [s[0][k] for s in self.samples if s[2]] or [s[0][k] for s in self.samples]
        half = len(pool) // 2
        if not half:
            return 0.0
        first, last = statistics.median(pool[:half]), statistics.median(pool[-half:])
        return max(first, last) / min(first, last) - 1.0


class _Engine:
    """One engine built as `localrun.LLM` builds it, running the model's first n_layers (None: all)."""

    def __init__(self, path, n_layers: int | None, n_ctx: int, n_parallel: int, threads: int | None,
                 kv_type: str | None = None):
        import localrun
        from localrun.engine.draft_model import self_draft
        from localrun.sampling_params import SamplingParams

        # no admission watermark: BATCH sequences of a full context are all admitted at once
        self.llm = localrun.LLM(path, n_ctx=n_ctx, n_parallel=n_parallel, n_threads=threads, kv_watermark=0.0,
                                kv_type=kv_type)
        if n_layers is not None and n_layers < self.llm.config.n_layers:
            self.llm.model = self_draft(self.llm.model, n_layers)   # before the engine is built from it
        self.n_vocab = self.llm.config.n_vocab
        self.params = SamplingParams(max_tokens=DECODE_STEPS, ignore_eos=True, seed=0)
        warm_up = min(64, n_ctx // 2)           # pages, threads, kernels: first-touch costs are not timed
        self.run([synthetic_prompt(warm_up, self.n_vocab, 10_000)], max_tokens=min(8, n_ctx - warm_up - 1))

    def run(self, prompts, max_tokens: int = DECODE_STEPS) -> list[StepTime]:
        return timed_steps(self.llm.engine, prompts, replace(self.params, max_tokens=max_tokens))[0]

    def decode(self, n_seqs: int, *fills: int) -> Rounds:
        """Rounds of the seconds per decode step of n_seqs sequences after each of `fills` prompt
        tokens each, the fills timed in turn within each round. A sequence's shorter prompts are
        the first tokens of its longest, and every round's the first round's: from the second
        round on they come from the prefix cache (where the pool keeps them), so a round costs
        its decode steps and not the prompts again. The median step is the same either way:
        after a prefix-cache hit over a fresh prompt 0.978-1.011 (16 alternated rounds in one
        process, SmolLM2 and gemma-3-270m at 32 and 2048 cached, 2 Zen 4 threads, 2026-12-05)."""
        prompts = [[synthetic_prompt(fill, self.n_vocab, i) for i in range(n_seqs)] for fill in fills]
        return Rounds(lambda _: tuple(decode_step_seconds(self.run(p), n_seqs) for p in prompts), DECODE_REPEATS,
                      typical=True)

    def prefill(self, sizes: tuple[int, ...], n: int) -> Rounds:
        """Rounds of the seconds of the prompt step of a prompt of each size (n among them), of `n`
        tokens as BATCH prompts in one step, and of `n` tokens after the `n`-token prompt (its blocks
        then come from the prefix cache); new prompts every round."""
        def step_s(prompts):
            return prefill_seconds(self.run(prompts, max_tokens=1))[1]

        def take(i):
            key = 1_000_000 + 100 * i
            prompts = [synthetic_prompt(size, self.n_vocab, key + j) for j, size in enumerate(sizes)]
            split = [synthetic_prompt(n // BATCH, self.n_vocab, key + 50 + j) for j in range(BATCH)]
            first = prompts[sizes.index(n)]
            return (*(step_s([p]) for p in prompts), step_s(split),
                    step_s([first + synthetic_prompt(n, self.n_vocab, key + 99)]))
        return Rounds(take, PREFILL_REPEATS, typical=True)


def measure_timings(path, threads: int | None = None):
    """The engine timings layerplan.engine_fit needs, for the model at `path`, and the quiet
    record: (EngineTimings, kv_type, others' cores at worst among the timings used, all quiet,
    drift). drift: how far the first timing (one sequence's decode step at the short fill) moved
    from the first half of its rounds to the second (Rounds.moved). On a
    virtual machine the host's other tenants move its speed while our own CPU shows no other
    work: on a 2-core Zen 3 VM a decode step took 6.7-9.1 ms within minutes with steal at 0.1%
    (docs/layerplan.md), and a calibration taken across such a move is not this machine's."""
    import layerplan
    from layerplan.engine_fit import EngineTimings

    profile = layerplan.profile_gguf(path)
    n_layers = profile.n_layers
    n_short = max(1, n_layers // 3)
    room, long_fill = _long_fill(profile)
    longer_fill = min(LONGER_FILL, room) if min(LONGER_FILL, room) >= 1.5 * long_fill else None
    middle_fill = MIDDLE_FILL if 2 * SHORT_FILL <= MIDDLE_FILL <= long_fill // 2 else None
    middle_fills = [middle_fill] if middle_fill else []
    n = min(ATTENTION_TOKENS, room // 2)                        # the cached timing holds twice as many
    n -= n % BATCH
    sizes = tuple(sorted({max(1, min(size, n * size // ATTENTION_TOKENS)) for size in PROMPT_SIZES}))  # one step each
    fills = [SHORT_FILL, *middle_fills, long_fill, *([longer_fill] if longer_fill else [])]

    # One sequence is timed on engines built for one (as `localrun chat` builds it), the batches on
    # one built for BATCH: an engine's weight layouts follow the sequences it is built for
    # (gguf_weight.lane_types; a Q8_0 head runs in lanes from 2 on, 1.2x a row's time for one row),
    # so a one-sequence step of the batch engine was slower than the plan's one-sequence case.
    # The BATCH engine also takes the prompt timings.
    def engine(n_layers, n_ctx, n_seqs, kv_type=None):
        return lambda: _Engine(path, n_layers, n_ctx + DECODE_STEPS + 16, n_seqs, threads, kv_type)
    plans = {"shallow": (engine(n_short, SHORT_FILL, 1), (1, SHORT_FILL)),
             "single": (engine(None, longer_fill or long_fill, 1), (1, *fills))}
    for name in OTHER_KV_TYPES:
        plans[f"{name} one"] = (engine(None, long_fill, 1, name), (1, SHORT_FILL, long_fill))
        plans[f"{name} batch"] = (engine(None, long_fill, BATCH, name), (BATCH, SHORT_FILL, long_fill))

    before = _resident_bytes()
    full = _Engine(path, None, max(long_fill, 2 * n, sizes[-1]) + DECODE_STEPS + 16, BATCH, threads)
    kv_type = full.llm.kv_type
    for name in [k for k in OTHER_KV_TYPES if k == kv_type]:   # the default cache is the one timed throughout
        del plans[f"{name} one"], plans[f"{name} batch"]
    rounds = {"batch": full.decode(BATCH, SHORT_FILL, *middle_fills, long_fill), "prompt": full.prefill(sizes, n)}
    if _room_for(len(plans), _resident_bytes() - before):
        # Every engine kept, and every timing taken a round at a time, each round of each after one
        # of all the others: a VM's host moves its speed in phases of tens of seconds to minutes,
        # and repeats taken within seconds measured one phase (a 4 x 256 prompt step took 549-653 ms
        # in four calibrations of one evening and the prefill predictions followed them; one
        # sequence's decode, timed back to back, met one phase while the benchmark's passes met
        # several: docs/layerplan.md, 2026-12-05).
        engines = {name: build() for name, (build, _) in plans.items()}
        rounds.update((name, engines[name].decode(*args)) for name, (_, args) in plans.items())
        while not all(r.done() for r in rounds.values()):
            for r in rounds.values():
                r.round()
        del engines
    else:   # one engine at a time, each timing's rounds taken one after the other
        for r in rounds.values():
            r.result()
        del full
        for name, (build, args) in plans.items():
            one = build()
            rounds[name] = one.decode(*args)
            rounds[name].result()
            del one
    records = []                                                # (others' cores, quiet) of each timing used

    def timed(name):
        values, others, all_quiet = rounds[name].result()
        records.append((others, all_quiet))
        return values

    batch_s, *batch_middle, batch_long_s = timed("batch")
    *prefill_s, split_s, cached_s = timed("prompt")
    (shallow_s,) = timed("shallow")
    by_fill = dict(zip(fills, timed("single")))
    short_s, long_s = by_fill[SHORT_FILL], by_fill[long_fill]
    # the first timing's first rounds against its last: how far the machine's speed moved meanwhile
    drift = rounds["single"].moved(fills.index(SHORT_FILL))
    other_kv = [(name, *timed(f"{name} one"), *timed(f"{name} batch"))
                for name in OTHER_KV_TYPES if f"{name} one" in rounds]
    middle = DECODE_STEPS / 2      # the median decode step is the middle one: its cache holds fill + that
    timings = EngineTimings(n_layers_short=n_short, batch=BATCH, fill_short=SHORT_FILL + middle,
                            fill_long=long_fill + middle, decode_short_shallow_s=shallow_s, decode_short_s=short_s,
                            decode_batch_s=batch_s, decode_batch_long_s=batch_long_s, prompt_tokens=sizes,
                            prefill_s=tuple(prefill_s), attention_tokens=n, prefill_split_s=split_s,
                            prefill_cached_s=cached_s, decode_long_s=long_s,
                            fill_longer=longer_fill + middle if longer_fill else None,
                            decode_longer_s=by_fill.get(longer_fill), kv_types=tuple(other_kv),
                            fill_middle=middle_fill + middle if middle_fill else None,
                            decode_middle_s=by_fill.get(middle_fill),
                            decode_batch_middle_s=batch_middle[0] if batch_middle else None)
    others = [o for o, _ in records if o is not None]
    return timings, kv_type, max(others) if others else None, all(q for _, q in records), drift


def _resident_bytes() -> int:
    import psutil
    return psutil.Process().memory_info().rss


def _room_for(n_engines: int, engine_bytes: int) -> bool:
    """Whether the host's available memory holds n_engines more engines of `engine_bytes` (what
    building the largest added to this process, its mapped weights included), and one more to spare."""
    import psutil
    return psutil.virtual_memory().available > (n_engines + 1) * engine_bytes


def _long_fill(profile) -> tuple[int, int]:
    """(room, long fill): the engines stay within the trained context."""
    room = profile.n_ctx_train - DECODE_STEPS - 16
    return room, max(SHORT_FILL * 2, min(LONG_FILL, room))


def reference_step_seconds(path, threads: int | None = None) -> tuple[float, float]:
    """The engine calibration's first two timings, taken afresh: one sequence's decode step at the
    short and at the long fill through all layers, on an engine built for one (the median of
    DECODE_REPEATS quiet repeats, taken one after the other). Against the calibration's own
    (Calibration.engine_reference_s, engine_reference_long_s) they say how far the machine's speed
    has moved since, which a VM's host can do by a third within minutes: the short step mostly
    computes, the long one mostly reads the KV cache from memory, and the host's other tenants
    move the two apart."""
    import layerplan
    _, long_fill = _long_fill(layerplan.profile_gguf(path))
    return _Engine(path, None, long_fill + DECODE_STEPS + 16, 1, threads).decode(1, SHORT_FILL, long_fill).result()[0]


def measure_timings_in_new_process(path, threads: int | None = None):
    """measure_timings in a fresh Python process, as the engine will run: the allocator's state
    decides how many pages a prompt step takes fresh from the kernel (see the module's notes), and
    a process that has just run the micro-benchmarks (hundreds of MiB allocated and freed) keeps
    pages an engine process would not, so its prompt steps look cheaper than a real engine's."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "localrun.calibrate_engine", str(path)] + ([str(threads)] if threads else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the engine calibration failed:\n{proc.stderr[-2000:]}")
    return read_timings(proc.stdout.strip().splitlines()[-1])


def read_timings(line: str):
    """measure_timings' result from the JSON line main() prints."""
    import json

    from layerplan.engine_fit import EngineTimings

    out = json.loads(line)
    t = out["timings"]
    timings = EngineTimings(**{**t, "prompt_tokens": tuple(t["prompt_tokens"]), "prefill_s": tuple(t["prefill_s"]),
                               "kv_types": tuple(tuple(k) for k in t.get("kv_types", ()))})
    return timings, out["kv_type"], out["other_cpu"], out["quiet"], out.get("drift")


def main(argv: list[str] | None = None) -> None:
    """python -m localrun.calibrate_engine MODEL.gguf [THREADS]: measure_timings, as one JSON line."""
    import json
    import sys
    from dataclasses import asdict

    args = sys.argv[1:] if argv is None else argv
    timings, kv_type, other_cpu, all_quiet, drift = measure_timings(args[0], int(args[1]) if len(args) > 1 else None)
    print(json.dumps({"timings": asdict(timings), "kv_type": kv_type, "other_cpu": other_cpu, "quiet": all_quiet,
                      "drift": drift}))


def measure_engine(path, calibration, threads: int | None = None, attempts: int | None = None, say=None):
    """`calibration` (layerplan.calibrate.Calibration of this host) with the engine's own figures
    for the model at `path`, fitted through the speed model (layerplan.engine_fit).

    A calibration across which the host's speed moved (its first timing's later rounds moved from
    its first by more than DRIFT_LIMIT, or the fitted model misses one timing by more than
    MISFIT_LIMIT) is taken again, up to `attempts` (ENGINE_ATTEMPTS) in all, and the steadiest one
    kept: on a VM the host's speed moves in phases of tens of seconds (docs/layerplan.md), so a
    second calibration often meets one phase throughout where the first met two. One that is suspect
    for other work on the CPU is not retaken (that work is still there). say(line), if given,
    hears why each retake happens."""
    from layerplan.calibrate import DRIFT_LIMIT, MISFIT_LIMIT

    attempts = ENGINE_ATTEMPTS if attempts is None else max(1, attempts)
    tried = []
    for attempt in range(1, attempts + 1):
        result, moved = _measure_engine_once(path, calibration, threads)
        tried.append(result)
        if not moved:
            break
        if attempt < attempts and say is not None:
            say(f"engine calibration {attempt} of {attempts}: {result.suspect_cause}; measuring again")

    def movement(c):   # how far past its limits the host moved during a calibration
        return max((c.drift or 0.0) / DRIFT_LIMIT, (c.misfit or 0.0) / MISFIT_LIMIT)
    best = min(tried, key=movement)
    if len(tried) > 1:
        which = tried.index(best) + 1
        best = replace(best, engine_model=best.engine_model + f"; attempt {which} of {len(tried)} (the steadiest: "
                       + ", ".join(f"{i + 1}: drift {c.drift or 0:.1%}, misfit {c.misfit or 0:.1%}"
                                   for i, c in enumerate(tried)) + ")")
    return best


def _measure_engine_once(path, calibration, threads: int | None):
    """(measure_engine's calibration from one set of timings, whether the host's speed moved
    across them: drift or misfit past its limit while nothing else made it suspect)."""
    import layerplan
    from layerplan.calibrate import DRIFT_LIMIT, MISFIT_LIMIT, apply, engine_key
    from layerplan.engine_fit import fit_host, residuals
    from layerplan.probe import probe_host

    from localrun.engine_build import engine_build

    timings, kv_type, other_cpu, all_quiet, drift = measure_timings_in_new_process(path, threads)
    profile = engine_profile(path)
    host = apply(layerplan.Machine(gpus=(), host=probe_host()), calibration).host
    fitted = fit_host(profile, host, kv_type, timings)
    misfit = {name: abs(r - 1) for name, r in residuals(profile, fitted, kv_type, timings).items()}
    worst_name = max(misfit, key=misfit.get)
    worst = misfit[worst_name]
    moved = drift is not None and drift > DRIFT_LIMIT or worst > MISFIT_LIMIT
    t = timings
    return replace(
        calibration,
        host_bandwidth=fitted.memory_bandwidth,      # the matvec's, or the engine's where its steps need more
        host_layer_overhead_s=fitted.layer_overhead_s, host_step_overhead_s=fitted.step_overhead_s,
        host_matmul_overhead_s=fitted.matmul_overhead_s,
        host_kv_bandwidth=fitted.kv_bandwidth, host_kv_cached_bytes=fitted.kv_cached_bytes,
        host_kv_batch_bandwidth=fitted.kv_batch_bandwidth or None, host_kv_batch_rows=fitted.kv_batch_rows or None,
        host_decode_flops=fitted.decode_flops,
        host_flops=fitted.compute_flops, host_unpack_bandwidth=fitted.unpack_bandwidth or None,
        host_attention_flops=fitted.attention_flops, host_causal_attention_flops=fitted.causal_attention_flops,
        host_kv_decode_flops={name: [one, batch, rows] for name, one, batch, rows in fitted.kv_decode_flops} or None,
        other_cpu=max(x for x in (calibration.other_cpu, other_cpu, 0.0) if x is not None),
        suspect=calibration.suspect or not all_quiet or moved,
        drift=drift, engine_reference_s=t.decode_short_s, engine_reference_long_s=t.decode_long_s, misfit=worst,
        engine_build=engine_build(),
        engine_model=(f"{profile.name}: {profile.n_layers} layers, {kv_type} KV, {threads or 'default'} threads; "
                      f"decode step {t.decode_short_shallow_s * 1e3:.2f} ms at {t.n_layers_short} layers, "
                      f"{t.decode_short_s * 1e3:.2f} ms at all, "
                      + (f"{t.decode_middle_s * 1e3:.2f} ms at {t.fill_middle:.0f} cached, " if t.decode_middle_s else "")
                      + (f"{t.decode_long_s * 1e3:.2f} ms at {t.fill_long:.0f} cached, " if t.decode_long_s else "")
                      + (f"{t.decode_longer_s * 1e3:.2f} ms at {t.fill_longer:.0f} cached, " if t.decode_longer_s else "")
                      + f"{t.decode_batch_s * 1e3:.2f} ms for {t.batch} sequences, "
                      + (f"{t.decode_batch_middle_s * 1e3:.2f} ms at {t.fill_middle:.0f} cached, "
                         if t.decode_batch_middle_s else "")
                      + f"{t.decode_batch_long_s * 1e3:.2f} ms at {t.fill_long:.0f} cached; prompt steps "
                      + ", ".join(f"{s * 1e3:.0f} ms for {n} tokens" for n, s in zip(t.prompt_tokens, t.prefill_s))
                      + f", {t.prefill_split_s * 1e3:.0f} ms for {t.batch} prompts of {t.attention_tokens // t.batch}"
                      f", {t.prefill_cached_s * 1e3:.0f} ms for {t.attention_tokens} after as many cached; "
                      + "".join(f"{name} KV: {short * 1e3:.2f} ms, {long * 1e3:.2f} ms at {t.fill_long:.0f} cached, "
                                f"{batch * 1e3:.2f} ms and {batch_long * 1e3:.2f} ms for {t.batch} sequences; "
                                for name, short, long, batch, batch_long in t.kv_types)
                      + f"the model reproduces these within {worst:.1%} (worst: {worst_name})"
                      + (f"; the first timing's later rounds moved from its first by {drift:.1%}"
                         if drift is not None else "")),
        backend="engine", engine_key=engine_key(path),
    ), moved and not calibration.suspect and all_quiet


if __name__ == "__main__":
    main()
