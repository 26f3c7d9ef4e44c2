"""The host's figures from timings of localrun's engine, fitted through layerplan's own speed model.

localrun/calibrate_engine.py times the engine on the model's own file (decode steps at two depths,
two batch sizes and four cache fills; prompt steps from an empty cache of several sizes and of one
size split into `batch` prompts, and one after a cached prefix); this module finds the figures of the host `Device` that make the speed model
(layerplan.speed.step_seconds) reproduce those timings. The decode figures come one by one, each
from a difference of timings that, in the model, depends only on it and on the figures found
before it (bisection on the model, which is monotone in each):

  1. KV bandwidth: one sequence decoding at the long fill against the short one (only its
     attention differs). Fitted on `batch` sequences instead, it came out at 12 GB/s on 2 Zen 4
     cores where one sequence reads its cache at ~17 (four rows over 2060 cached tokens are
     split over the threads otherwise than one long row), and every one-sequence step over a
     long context was predicted 1.2x too slow (docs/layerplan.md); the batch's long timing is
     now a residual the fit does not chase. A third, longer fill gives the KV bytes a step reads
     at no cost because the CPU's caches hold them between steps (`_fit_kv`): on a 2-core Zen 3
     (32 MB L3) one sequence's step cost the same at 32 and 1024 cached tokens of SmolLM2 and
     2-4 us per token more past that, so one bandwidth fitted on 44 and 2060 tokens predicted
     4096 tokens 1.5x too fast. A fourth, middle fill makes the two figures a least-squares fit
     (in another hour the same host's steps grew from the short fill on, and a knee put by the
     long and longer fills alone missed every step at ~500 cached tokens by a quarter);
  2. decode flop/s: `batch` sequences against one, at the short fill (their decode rows' matmuls
     and the head's rows differ; attention by the bandwidth just found);
  3. per-layer overhead (with every matmul call's fixed cost): one sequence through all layers
     against the first n_layers_short;
  4. per-step overhead: the whole stack's decode step less its layers and head.

Last, for each other KV type the engine was timed with (one sequence and `batch` sequences, each
at the short and the long fill, over an int8 or fp8 cache), the rates of decode attention over
that type for one row and for the batch (`_fit_kv_types`): its bytes read as the calibration's own
type's do, so what its long step costs beyond the model's is put on the kernel's widening and
scaling of each value (with a quantized cache's fixed cost per step, which the rates fold in at
the long fill).

The prompt figures act together in every prompt step, so they are solved together, by damped
Newton steps on the logarithms of the figures and of the timings (`_solve_logs`, least squares);
still, each kind of timing mostly decides one figure:

  5. prompt sizes from 128 tokens to most of a step, from an empty cache: a fixed cost per step
     (unpacking the weights) and a cost per token (prompt flop/s). The cost per token of the
     GEMM varies with the step's size (on a 2-core Xeon by +-8%, not monotonically: 1024 rows
     are cheaper per row than 479), so several sizes are fitted, not two, and the line is their
     average rather than the cheapest size's;
  6. attention_tokens as `batch` prompts in one step against one prompt: the same matmuls, a
     quarter of the causal attention (causal attention flop/s);
  7. attention_tokens again after as many cached (a prefix-cache hit): masked attention over
     every key up to the chunk's end (attention flop/s).

Either way the fit stays true to whatever the model computes (rooflines, the head, attention),
and timings the model predicts give back the figures they came from (tests/test_engine_fit.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from layerplan.devices import Device, Machine
from layerplan.model_profile import ModelProfile
from layerplan.placement import place
from layerplan.settings import PlanSettings
from layerplan.speed import step_kv_bytes, step_seconds

RATE_RANGE = (1e6, 1e16)      # bytes/s or flop/s the bisection searches in
UNSEEN_RATE = RATE_RANGE[1] / 10  # a rate fitted this high: its cost did not show in the timings
OVERHEAD_CAP_S = 1.0          # a per-layer or per-step overhead beyond this is a broken timing


@dataclass(frozen=True)
class EngineTimings:
    """What the engine was timed at. Fills are the mean tokens cached over the timed decode steps."""
    n_layers_short: int              # layers of the shallow stack (the model's first ones, plus the head)
    batch: int                       # sequences in the batched decode timings
    fill_short: float
    fill_long: float
    decode_short_shallow_s: float    # seconds per decode step: one sequence, short fill, shallow stack
    decode_short_s: float            # one sequence, short fill, all layers
    decode_batch_s: float            # `batch` sequences, short fill, all layers
    decode_batch_long_s: float       # `batch` sequences, long fill, all layers
    prompt_tokens: tuple[int, ...]   # prompt sizes (two or more), each prefilled in one step from an empty cache
    prefill_s: tuple[float, ...]     # seconds of each one's step
    attention_tokens: int            # the size of the two attention timings:
    prefill_split_s: float           # seconds of one step prefilling `batch` prompts of attention_tokens / batch
    prefill_cached_s: float          # seconds of the step of attention_tokens new tokens after as many cached
    decode_long_s: float | None = None   # one sequence, long fill, all layers (None: a calibration from before it)
    fill_longer: float | None = None     # a third fill, past the long one (None: not timed)
    decode_longer_s: float | None = None  # one sequence, the third fill, all layers
    fill_middle: float | None = None     # a fill between the short and the long one (None: not timed)
    decode_middle_s: float | None = None  # one sequence, the middle fill, all layers
    decode_batch_middle_s: float | None = None  # `batch` sequences, the middle fill, all layers
    kv_types: tuple[tuple[str, float, float, float, float], ...] = ()  # (another KV type, seconds per decode
                                     # step over a cache of that type: one sequence at fill_short, at fill_long,
                                     # `batch` sequences at fill_short, at fill_long)


def _solve_rate(seconds_at, target: float, unseen: float) -> float:
    """The rate r (bytes/s or flop/s) at which seconds_at(r), decreasing in r, equals target:
    bisection in log space within RATE_RANGE. A target below what any rate reaches (the timing
    difference is noise, or the cost too small to see) gives `unseen`, the figure kept instead."""
    lo, hi = RATE_RANGE
    if seconds_at(hi) >= target:
        return unseen
    if seconds_at(lo) <= target:
        return lo
    for _ in range(64):    # 2^-64 of the range's log: far below timing noise
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if seconds_at(mid) > target else (lo, mid)
    rate = math.sqrt(lo * hi)
    return unseen if rate >= UNSEEN_RATE else rate


class _Model:
    """Step times of the model on a host-only machine whose figures the fit changes."""

    def __init__(self, profile: ModelProfile, kv_type: str):
        self.profile, self.kv_type = profile, kv_type
        self.kv_name = PlanSettings(n_ctx=1, kv_type=kv_type).kv.name    # layerplan's name of the type
        self._layouts = {}

    def decode(self, host: Device, n_seqs: int, fill: float, n_layers: int | None = None) -> float:
        return self._step(host, ((1, fill),) * n_seqs, n_seqs, True, n_layers)

    def decode_kv_bytes(self, host: Device, n_seqs: int, fill: float) -> float:
        """KV bytes a decode step of n_seqs sequences at `fill` reads (all layers)."""
        profile, settings, placement = self._layout(host, None, n_seqs)
        return step_kv_bytes(profile, Machine(gpus=(), host=host), placement, settings, ((1, fill),) * n_seqs,
                             decode=True)

    def prefill(self, host: Device, n_tokens: int, n_cached: int = 0, n_prompts: int = 1) -> float:
        """One prompt step: n_prompts prompts of n_tokens / n_prompts each, after n_cached cached tokens."""
        return self._step(host, ((n_tokens // n_prompts, n_cached),) * n_prompts, n_prompts, False, None)

    def _layout(self, host: Device, n_layers: int | None, n_seqs: int):
        """(profile, settings, placement) of the stack's first n_layers (None: all), every layer on the
        host: the placement's device indices do not depend on the host's figures, so it is kept."""
        key = (n_layers, n_seqs)
        if key not in self._layouts:
            p = self.profile
            profile = p if n_layers is None else replace(p, n_layers=n_layers, layers=p.layers[:n_layers])
            settings = PlanSettings(n_ctx=max(profile.n_ctx_train, 1), n_parallel=n_seqs, kv_type=self.kv_type,
                                    margin_bytes=0)
            self._layouts[key] = (profile, settings, place(profile, Machine(gpus=(), host=host), settings, 0))
        return self._layouts[key]

    def _step(self, host, entries, n_logits, decode, n_layers) -> float:
        profile, settings, placement = self._layout(host, n_layers, len(entries))
        return step_seconds(profile, Machine(gpus=(), host=host), placement, settings, entries,
                            n_logits=n_logits, decode=decode)


def fit_host(profile: ModelProfile, host: Device, kv_type: str, t: EngineTimings) -> Device:
    """`host` with the figures that make the speed model reproduce the engine timings `t`:
    kv_bandwidth, kv_cached_bytes, kv_batch_bandwidth (and kv_batch_rows), decode_flops, layer_overhead_s,
    step_overhead_s, unpack_bandwidth, compute_flops, causal_attention_flops, attention_flops and
    kv_decode_flops; its memory bandwidth stays as given unless the decode steps are faster than the
    model can make them with it (then the least that reaches them: the engine's own weight streaming).

    The matmul overhead goes to zero: the engine runs the same matmuls in every layer, so the fixed
    cost of each call is part of what the per-layer overhead measures (and the head's, of the
    per-step one), and the two cannot be told apart from these timings. Kept from the
    micro-benchmarks (torch's matvec, not the engine's kernels) it can exceed what a whole layer
    of the engine takes, and the model then predicts every decode step slower than measured
    whatever the other figures are (docs/layerplan.md has the case)."""
    m = _Model(profile, kv_type)
    h = replace(host, unpack_bandwidth=0.0, matmul_overhead_s=0.0, kv_decode_flops=())
    for _ in range(3):    # decode attention's roofline reads attention_flops, found last: go round again
        h = _fit_once(m, replace(h, layer_overhead_s=0.0, step_overhead_s=0.0), t)
    return _fit_kv_types(profile, h, t)


def _fit_once(m: _Model, h: Device, t: EngineTimings) -> Device:
    # 1. attention: only the cache fill differs between the timings of one sequence (of the batch
    #    in a calibration without the one-sequence one); then the batch's own rate, from its two fills
    h = _fit_kv_batch(m, _fit_kv(m, h, t), t)

    # 2. decode rows: `batch` sequences against one at the same fill (per-layer and per-step costs cancel)
    def rows_cost(decode_flops):
        x = replace(h, decode_flops=decode_flops)
        return m.decode(x, t.batch, t.fill_short) - m.decode(x, 1, t.fill_short)
    h = replace(h, decode_flops=_solve_rate(rows_cost, t.decode_batch_s - t.decode_short_s, h.decode_flops))

    # 3. per layer: the model is linear in the layer overhead, so the slope over depth gives it
    n1, n2 = t.n_layers_short, m.profile.n_layers

    def with_layer_overhead(x: Device) -> Device:
        if n2 <= n1:
            return x
        x = replace(x, layer_overhead_s=0.0)
        modelled = (m.decode(x, 1, t.fill_short) - m.decode(x, 1, t.fill_short, n1)) / (n2 - n1)
        measured = (t.decode_short_s - t.decode_short_shallow_s) / (n2 - n1)
        return replace(x, layer_overhead_s=min(OVERHEAD_CAP_S, max(0.0, measured - modelled)))
    h = with_layer_overhead(h)

    # 3b. a step the model makes slower than measured even with nothing per step: the engine streams
    #     its weights faster than the micro-benchmarks' matvec did (on 2 Zen 4 cores gemma-3-270m's
    #     178 MB Q8_0 head and 6 layers took 9.4 ms a step, 10.5 by the matvec's 22 GB/s), so the
    #     memory bandwidth is the least that lets the model reach the step, with the layer overhead
    #     refitted at each try (the slope over depth stays the measured one)
    def whole_step(bandwidth: float) -> float:
        return m.decode(with_layer_overhead(replace(h, memory_bandwidth=bandwidth)), 1, t.fill_short)
    if t.decode_short_s < m.decode(h, 1, t.fill_short):
        bandwidth = _solve_rate(whole_step, t.decode_short_s, h.memory_bandwidth)
        h = with_layer_overhead(replace(h, memory_bandwidth=max(bandwidth, h.memory_bandwidth)))

    # 4. per step: what the whole stack's decode step costs beyond the model of its parts
    h = replace(h, step_overhead_s=min(OVERHEAD_CAP_S, max(0.0, t.decode_short_s - m.decode(h, 1, t.fill_short))))

    # 5-7. prompt steps: unpacking, flop/s, causal and masked attention, all four timings at once
    names = ("unpack_bandwidth", "compute_flops", "causal_attention_flops", "attention_flops")
    n = t.attention_tokens

    def prompt_steps(logs):
        x = replace(h, **{name: math.exp(v) for name, v in zip(names, logs)})
        return [m.prefill(x, size) for size in t.prompt_tokens] + [m.prefill(x, n, n_prompts=t.batch),
                                                                   m.prefill(x, n, n)]
    start = [math.log(h.unpack_bandwidth or 1e9)] + [math.log(h.compute_flops)] * 3
    logs = _solve_logs(prompt_steps, [*t.prefill_s, t.prefill_split_s, t.prefill_cached_s], start)
    rates = dict(zip(names, (math.exp(v) for v in logs)))
    # A rate that drifted to the top of the range saw no cost: 0.0, so that the speed model
    # takes its stand-in (no unpacking; compute_flops for the attention rates) rather than a
    # rate of ~1e16 (exp(log(1e16)) is 1.0000000000000034e16).
    for name in ("unpack_bandwidth", "causal_attention_flops", "attention_flops"):
        if rates[name] >= UNSEEN_RATE:
            rates[name] = 0.0
    return replace(h, **rates)


def _fit_kv(m: _Model, h: Device, t: EngineTimings) -> Device:
    """kv_bandwidth and kv_cached_bytes from one sequence's decode timings at its cache fills.

    Each fill past the short one adds to the step what the model says: its KV bytes beyond what
    the CPU's caches keep between steps (kv_cached_bytes, C) at kv_bandwidth. With the short fill
    and two more (long, longer) that is two differences for two figures, solved exactly; with a
    third (the middle fill) the pair is the least-squares one (`_knee_line`), so no one timing
    decides where the caches stop: on 2 Zen 3 cores the exact pair put C at 22 MB of SmolLM2's
    cache, while the steps grew by ~2 us per cached token from the short fill on, and every step
    at ~500 cached tokens was predicted 0.75-0.79x its time (docs/layerplan.md). The line is
    fitted to the timings less what the model adds beyond it (attention's flops where they bind,
    the short fill's own bytes), which are retaken at each round until the figures settle, so
    timings the model predicts give back their figures exactly. With the long fill alone (or no
    positive slope to see: noise), C stays 0 and the bandwidth comes from the long fill."""
    one_row = t.decode_long_s is not None
    rows, long_s, short_s = ((1, t.decode_long_s, t.decode_short_s) if one_row
                             else (t.batch, t.decode_batch_long_s, t.decode_batch_s))

    def fill_cost(x: Device, fill: float) -> float:
        return m.decode(x, rows, fill) - m.decode(x, rows, t.fill_short)

    h = replace(h, kv_cached_bytes=0.0, kv_batch_bandwidth=0.0, kv_batch_rows=0)
    plain = replace(h, kv_bandwidth=_solve_rate(lambda bw: fill_cost(replace(h, kv_bandwidth=bw), t.fill_long),
                                                long_s - short_s, h.kv_bandwidth))
    points = [(f, s) for f, s in ((t.fill_middle, t.decode_middle_s), (t.fill_long, long_s),
                                  (t.fill_longer, t.decode_longer_s)) if f and s is not None]
    if not one_row or len(points) < 2:
        return plain
    b0 = m.decode_kv_bytes(h, 1, t.fill_short)
    fills, seconds = [f for f, _ in points], [s for _, s in points]
    b = [m.decode_kv_bytes(h, 1, f) for f in fills]
    weights = [1.0 / s ** 2 for s in seconds]      # relative to each step's time, as the plan is judged
    beyond = [0.0] * len(points)                   # what the model adds to each fill beyond the line
    for _ in range(200):   # the model's extras move with C: settles by a constant factor a round
        fit = _knee_line(b0, b, [s - short_s - a for s, a in zip(seconds, beyond)], weights)
        if fit is None:
            return plain
        cached, per_byte = fit
        x = replace(h, kv_cached_bytes=cached, kv_bandwidth=1.0 / per_byte)
        line = [(max(0.0, bi - cached) - max(0.0, b0 - cached)) * per_byte for bi in b]
        before, beyond = beyond, [fill_cost(x, f) - v for f, v in zip(fills, line)]
        if max(abs(a - c) for a, c in zip(beyond, before)) <= 1e-9 * max(seconds):
            break
    return x


def _knee_line(b0: float, b: list[float], d: list[float], w: list[float]) -> tuple[float, float] | None:
    """(C, k): the bytes the caches hold and the seconds per byte beyond them that fit, in weighted
    least squares, the costs d[i] of steps reading b[i] KV bytes over one reading b0 (< every b[i]):
    d[i] ~ k * (max(0, b[i] - C) - max(0, b0 - C)), C within 0..the second-largest b (a C past
    it leaves one fill to fit the slope alone), k > 0. Exact: on each stretch of C between the
    bytes of two fills the fills read past C are fixed, and the fit there is a weighted line through
    them (d = k b - k C), or its ends. Among fits equally good, the least C (a cost the timings do
    not show is not assumed cached). None where no positive k fits (no cost to see)."""
    ends = sorted({0.0, b0, *sorted(b)[:-1]})      # every stretch's ends, up to the second-largest b
    best = None

    def consider(cached: float) -> None:
        nonlocal best
        e = [max(0.0, bi - cached) - max(0.0, b0 - cached) for bi in b]
        see = sum(wi * ei * ei for wi, ei in zip(w, e))
        if see <= 0:
            return
        k = sum(wi * ei * di for wi, ei, di in zip(w, e, d)) / see
        if k <= 0:
            return
        sse = sum(wi * (k * ei - di) ** 2 for wi, ei, di in zip(w, e, d))
        scale = sum(wi * di * di for wi, di in zip(w, d)) or 1.0
        if best is None or sse < best[0] - 1e-12 * scale or (sse <= best[0] + 1e-12 * scale and cached < best[1]):
            best = (sse, cached, k)

    for lo, hi in zip(ends, ends[1:]):
        for c in (lo, hi):
            consider(c)
        if hi <= b0:
            continue                                   # the short fill reads past C too: C does not matter
        past = [i for i, bi in enumerate(b) if bi >= hi]
        sw = sum(w[i] for i in past)
        if len(past) < 2 or sw <= 0:
            continue
        mb = sum(w[i] * b[i] for i in past) / sw
        md = sum(w[i] * d[i] for i in past) / sw
        sbb = sum(w[i] * (b[i] - mb) ** 2 for i in past)
        if sbb <= 0:
            continue
        k = sum(w[i] * (b[i] - mb) * (d[i] - md) for i in past) / sbb
        if k > 0:
            cached = mb - md / k                       # the line d = k (b - C) through the weighted means
            if lo < cached < hi:
                consider(cached)
    return None if best is None else (best[1], best[2])


def _fit_kv_batch(m: _Model, h: Device, t: EngineTimings) -> Device:
    """kv_batch_bandwidth (at kv_batch_rows = t.batch rows) from the batch's decode timings at the
    long fill (and the middle one, where timed) against the short one, with one sequence's figures
    (_fit_kv) in place: the rate at which the batch's KV beyond the caches reads. With both fills
    the rate is the one whose modelled steps fit both best (least squares of the logs of the step
    times, `_solve_logs`, as the prompt figures): on 2 Zen 4 cores four rows' cost per cached
    token was steeper up to ~500 tokens than past it, and the long fill alone put a 4-sequence
    step at ~500 cached tokens at 11.3 ms where it took ~14.8. Left at 0 (every step at
    kv_bandwidth) where one sequence's timings are missing (the batch's then gave kv_bandwidth
    itself) or no fill cost anything to see."""
    if t.decode_long_s is None or t.batch <= 1:
        return h
    x = replace(h, kv_batch_rows=t.batch)

    def fill_cost(bw: float, fill: float) -> float:
        y = replace(x, kv_batch_bandwidth=bw)
        return m.decode(y, t.batch, fill) - m.decode(y, t.batch, t.fill_short)
    rate = _solve_rate(lambda bw: fill_cost(bw, t.fill_long), t.decode_batch_long_s - t.decode_batch_s, 0.0)
    if t.fill_middle and t.decode_batch_middle_s is not None:
        # both fills' steps as the measured short step plus the modelled fill cost (the per-layer and
        # per-step costs are fitted after this, so only differences are the model's yet), in least
        # squares of their logs
        fills = (t.fill_middle, t.fill_long)
        (log_rate,) = _solve_logs(
            lambda logs: [t.decode_batch_s + fill_cost(math.exp(logs[0]), f) for f in fills],
            [t.decode_batch_middle_s, t.decode_batch_long_s], [math.log(rate or x.kv_bandwidth or 1e9)])
        rate = math.exp(log_rate)
        rate = rate if rate < UNSEEN_RATE else 0.0
    return replace(x, kv_batch_bandwidth=rate) if rate else h


def _fit_kv_types(profile: ModelProfile, h: Device, t: EngineTimings) -> Device:
    """kv_decode_flops: for each other KV type timed, the rates of decode attention over such a cache
    that make the model's step at its long fill what it measured, first for one sequence, then for
    the batch (with one's in place), every other figure as fitted on the calibration's own type
    (the same caches and bandwidth for its bytes). The step itself, not its long fill's cost over
    its short one: such a cache's steps cost more than the calibration's own type's already at the
    short fill (2 Zen 4 cores, SmolLM2, 4 rows at 44 cached: int8 10.35 ms, fp8 9.82, float16
    8.63), which a fit of the difference left out, missing the int8 batch's long step by 10-13% in
    three calibrations of four (docs/layerplan.md, 2026-12-05, later). A step that cost no more
    than reading its bytes (the roofline's other side) gives UNSEEN_RATE for those rows (their
    flops never bind), and a type where both did, no rates of its own. One row's long fill can
    cost nothing to see while the batch's costs plenty (2 Zen 4 cores, int8: 8.47 -> 9.68 ms for
    one row, 11.26 -> 20.92 for four): the batch keeps its rate then, which the calibration missed
    by 36% when it was dropped."""
    rates = []
    for name, _, long_s, _, batch_long_s in t.kv_types:
        m = _Model(profile, name)

        def long_step(one: float, batch: float, rows: int) -> float:
            return m.decode(replace(h, kv_decode_flops=((m.kv_name, one, batch, t.batch),)), rows, t.fill_long)
        one = _solve_rate(lambda r: long_step(r, 0.0, 1), long_s, 0.0) or UNSEEN_RATE
        batch = (_solve_rate(lambda r: long_step(one, r, t.batch), batch_long_s, UNSEEN_RATE)
                 if t.batch > 1 else 0.0)
        if one == UNSEEN_RATE and batch in (UNSEEN_RATE, 0.0):
            continue
        rates.append((m.kv_name, one, batch, t.batch))
    return replace(h, kv_decode_flops=tuple(sorted(rates)))


def _solve_logs(seconds_of, measured: list[float], start: list[float], iterations: int = 200) -> list[float]:
    """Logs of rates (within RATE_RANGE) at which seconds_of(logs) matches `measured` best, in
    least squares of log(modelled / measured): damped Newton (Levenberg-Marquardt), the Jacobian
    by finite differences. A rate the timings cannot see drifts to a bound of the range."""
    lo, hi = (math.log(r) for r in RATE_RANGE)
    targets = [math.log(v) for v in measured]

    def misfit(logs):
        r = [math.log(v) - t for v, t in zip(seconds_of(logs), targets)]
        return r, sum(v * v for v in r)

    logs, damping = list(start), 1e-3
    r, cost = misfit(logs)
    for _ in range(iterations):
        if cost < 1e-20:
            break
        jacobian = []                        # d r_i / d log(rate_j)
        for j in range(len(logs)):
            bumped = list(logs)
            bumped[j] += 1e-4
            jacobian.append([(a - b) / 1e-4 for a, b in zip(misfit(bumped)[0], r)])
        jtj = [[sum(jacobian[a][i] * jacobian[b][i] for i in range(len(r))) for b in range(len(logs))]
               for a in range(len(logs))]
        jtr = [sum(jacobian[a][i] * r[i] for i in range(len(r))) for a in range(len(logs))]
        while damping < 1e12:
            system = [[jtj[a][b] + (damping * (jtj[a][a] + 1e-12) if a == b else 0.0) for b in range(len(logs))]
                      for a in range(len(logs))]
            step = _solve_linear(system, [-v for v in jtr])
            trial = [min(hi, max(lo, v + d)) for v, d in zip(logs, step)]
            trial_r, trial_cost = misfit(trial)
            if trial_cost < cost:
                logs, r, cost, damping = trial, trial_r, trial_cost, max(damping / 10, 1e-9)
                break
            damping *= 10
        else:
            break                            # no step improves: as close as the model gets
    return logs


def _solve_linear(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b (Gaussian elimination with partial pivoting; a small dense system)."""
    n = len(b)
    rows = [list(row) + [v] for row, v in zip(a, b)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda i: abs(rows[i][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        if rows[col][col] == 0:
            continue
        for i in range(col + 1, n):
            f = rows[i][col] / rows[col][col]
            rows[i] = [x - f * y for x, y in zip(rows[i], rows[col])]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (rows[i][n] - sum(rows[i][j] * x[j] for j in range(i + 1, n))) / rows[i][i] if rows[i][i] else 0.0
    return x


def residuals(profile: ModelProfile, host: Device, kv_type: str, t: EngineTimings) -> dict[str, float]:
    """Measured over modelled seconds for each timing, with the host's figures as they are."""
    m = _Model(profile, kv_type)
    return {"decode_short_shallow": t.decode_short_shallow_s / m.decode(host, 1, t.fill_short, t.n_layers_short),
            "decode_short": t.decode_short_s / m.decode(host, 1, t.fill_short),
            "decode_batch": t.decode_batch_s / m.decode(host, t.batch, t.fill_short),
            "decode_batch_long": t.decode_batch_long_s / m.decode(host, t.batch, t.fill_long),
            **({"decode_long": t.decode_long_s / m.decode(host, 1, t.fill_long)} if t.decode_long_s is not None else {}),
            **({"decode_longer": t.decode_longer_s / m.decode(host, 1, t.fill_longer)}
               if t.decode_longer_s is not None and t.fill_longer else {}),
            **({"decode_middle": t.decode_middle_s / m.decode(host, 1, t.fill_middle)}
               if t.decode_middle_s is not None and t.fill_middle else {}),
            **({"decode_batch_middle": t.decode_batch_middle_s / m.decode(host, t.batch, t.fill_middle)}
               if t.decode_batch_middle_s is not None and t.fill_middle else {}),
            **{f"decode_long_{k[0]}": k[2] / _Model(profile, k[0]).decode(host, 1, t.fill_long) for k in t.kv_types},
            **{f"decode_batch_long_{k[0]}": k[4] / _Model(profile, k[0]).decode(host, t.batch, t.fill_long)
               for k in t.kv_types},
            **{f"prefill_{n}": s / m.prefill(host, n) for n, s in zip(t.prompt_tokens, t.prefill_s)},
            "prefill_split": t.prefill_split_s / m.prefill(host, t.attention_tokens, n_prompts=t.batch),
            "prefill_cached": t.prefill_cached_s / m.prefill(host, t.attention_tokens, t.attention_tokens)}
