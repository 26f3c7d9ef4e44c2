"""The host's figures from timings of localrun's engine, fitted through layerplan's own speed model.

localrun/calibrate_engine.py times the engine on the model's own file (decode steps at two depths,
two batch sizes and two cache fills; two prompt sizes); this module finds the figures of the host
`Device` that make the speed model (layerplan.speed.step_seconds) reproduce those timings. Each
figure comes from one difference of timings that, in the model, depends only on it and on the
figures found before it:

  1. KV bandwidth: `batch` sequences decoding at the long fill against the short one (only their
     attention differs);
  2. decode flop/s: `batch` sequences against one, at the short fill (their decode rows' matmuls
     and the head's rows differ; attention by the bandwidth just found);
  3. per-layer overhead: one sequence through all layers against the first n_layers_short;
  4. per-step overhead: the whole stack's decode step less its layers and head;
  5. attention flop/s: the large prompt's step after as many cached tokens (a prefix-cache hit)
     against its step from an empty cache (only its attention differs);
  6. prompt flop/s and unpack bandwidth: two prompt sizes (each one step from an empty cache), a
     cost per token and a fixed cost per step.

Each figure is found by bisection on the model itself (monotone in each), so the fit stays true to
whatever the model computes (rooflines, the head, attention), and timings the model predicts give
back the figures they came from (tests/test_engine_fit.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from layerplan.devices import Device, Machine
from layerplan.model_profile import ModelProfile
from layerplan.placement import place
from layerplan.settings import PlanSettings
from layerplan.speed import chunk_keys, step_seconds

RATE_RANGE = (1e6, 1e16)      # bytes/s or flop/s the bisection searches in
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
    prompt_tokens: tuple[int, int]   # two prompt sizes, each prefilled in one step from an empty cache
    prefill_s: tuple[float, float]   # seconds of each one's step
    prefill_cached_s: float          # seconds of the step of prompt_tokens[1] new tokens after as many cached


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
    return math.sqrt(lo * hi)


class _Model:
    """Step times of the model on a host-only machine whose figures the fit changes."""

    def __init__(self, profile: ModelProfile, kv_type: str):
        self.profile, self.kv_type = profile, kv_type
        self._layouts = {}

    def decode(self, host: Device, n_seqs: int, fill: float, n_layers: int | None = None) -> float:
        return self._step(host, ((1, fill),) * n_seqs, n_seqs, True, n_layers)

    def prefill(self, host: Device, n_tokens: int, n_cached: int = 0) -> float:
        return self._step(host, ((n_tokens, chunk_keys(n_cached, n_tokens)),), 1, False, None)

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
    kv_bandwidth, decode_flops, layer_overhead_s, step_overhead_s, attention_flops, compute_flops
    and unpack_bandwidth (its memory bandwidth and matmul overhead stay as given)."""
    m = _Model(profile, kv_type)
    h = replace(host, unpack_bandwidth=0.0)
    for _ in range(3):    # decode attention's roofline reads attention_flops, found later: go round again
        h = _fit_once(m, replace(h, layer_overhead_s=0.0, step_overhead_s=0.0), t)
    return h


def _fit_once(m: _Model, h: Device, t: EngineTimings) -> Device:
    # 1. attention: only the cache fill differs between the two batched timings
    def fill_cost(kv_bandwidth):
        x = replace(h, kv_bandwidth=kv_bandwidth)
        return m.decode(x, t.batch, t.fill_long) - m.decode(x, t.batch, t.fill_short)
    h = replace(h, kv_bandwidth=_solve_rate(fill_cost, t.decode_batch_long_s - t.decode_batch_s, h.kv_bandwidth))

    # 2. decode rows: `batch` sequences against one at the same fill (per-layer and per-step costs cancel)
    def rows_cost(decode_flops):
        x = replace(h, decode_flops=decode_flops)
        return m.decode(x, t.batch, t.fill_short) - m.decode(x, 1, t.fill_short)
    h = replace(h, decode_flops=_solve_rate(rows_cost, t.decode_batch_s - t.decode_short_s, h.decode_flops))

    # 3. per layer: the model is linear in the layer overhead, so the slope over depth gives it
    n1, n2 = t.n_layers_short, m.profile.n_layers
    if n2 > n1:
        modelled = (m.decode(h, 1, t.fill_short) - m.decode(h, 1, t.fill_short, n1)) / (n2 - n1)
        measured = (t.decode_short_s - t.decode_short_shallow_s) / (n2 - n1)
        h = replace(h, layer_overhead_s=min(OVERHEAD_CAP_S, max(0.0, measured - modelled)))

    # 4. per step: what the whole stack's decode step costs beyond the model of its parts
    h = replace(h, step_overhead_s=min(OVERHEAD_CAP_S, max(0.0, t.decode_short_s - m.decode(h, 1, t.fill_short))))

    # 5. attention in prompt steps: the same new tokens after a cached prefix, against none
    (small, large), (small_s, large_s) = t.prompt_tokens, t.prefill_s

    def cached_cost(attention_flops):
        x = replace(h, attention_flops=attention_flops)
        return m.prefill(x, large, large) - m.prefill(x, large)
    h = replace(h, attention_flops=_solve_rate(cached_cost, t.prefill_cached_s - large_s, h.attention_flops))

    # 6. prompt steps: a fixed unpacking cost per step and a cost per token, from the two sizes
    flops, unpack = h.compute_flops, h.unpack_bandwidth
    for _ in range(40):    # alternate: the large prompt mostly decides flop/s, the small one the unpacking
        previous = flops
        flops = _solve_rate(lambda f: m.prefill(replace(h, compute_flops=f, unpack_bandwidth=unpack), large), large_s,
                            h.compute_flops)
        unpack = _solve_rate(lambda u: m.prefill(replace(h, compute_flops=flops, unpack_bandwidth=u), small), small_s,
                             0.0)     # no fixed cost to see: weights are not unpacked
        if abs(flops - previous) <= 1e-9 * flops:
            break
    return replace(h, compute_flops=flops, unpack_bandwidth=unpack)


def residuals(profile: ModelProfile, host: Device, kv_type: str, t: EngineTimings) -> dict[str, float]:
    """Measured over modelled seconds for each timing, with the host's figures as they are."""
    m = _Model(profile, kv_type)
    return {"decode_short_shallow": t.decode_short_shallow_s / m.decode(host, 1, t.fill_short, t.n_layers_short),
            "decode_short": t.decode_short_s / m.decode(host, 1, t.fill_short),
            "decode_batch": t.decode_batch_s / m.decode(host, t.batch, t.fill_short),
            "decode_batch_long": t.decode_batch_long_s / m.decode(host, t.batch, t.fill_long),
            "prefill_small": t.prefill_s[0] / m.prefill(host, t.prompt_tokens[0]),
            "prefill_large": t.prefill_s[1] / m.prefill(host, t.prompt_tokens[1]),
            "prefill_cached": t.prefill_cached_s / m.prefill(host, t.prompt_tokens[1], t.prompt_tokens[1])}
