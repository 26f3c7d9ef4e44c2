"""What an engine step costs, from what it carries: the model an inter-token latency target
composes steps with (scheduler.py, `itl_target_s`). Torch-free, like the scheduler.

A step carries d decode or verify rows, p prompt tokens, and those prompt tokens attend
a keys in all (a prompt token at position q attends q + 1 keys). On a CPU the three cost very
differently: decode rows run the fused one-call-per-block path, prompt rows the Python path
(and float32 products with prompt_math float32) whose cost per token is higher for a small
chunk, and a chunk's attention grows with the context it sits on. Keyed by its token count
alone, a step of 8 decodes and a 16-token chunk over 1500 cached tokens was predicted as a
24-row decode step and took 4-5x that (docs/measurements.md): the controller then
over-packed every mixed step, or, learning from both kinds under one key, shrank every chunk to
a block. So:

    cost(d, p, a) = D(d)                              with no prompt tokens
                  = D(d) + c0 + c1 * p + c2 * a       with some

- D: the decode-only steps' own times (`StepCostModel`: the median per row count, one scratch
  forward for a count not seen yet).
- c0, c1, c2: a least-squares fit, over the last WINDOW steps that carried prompt tokens, of
  their time less D(d); ridge-pulled towards a prior (c1 from one scratch forward of
  PRIOR_TOKENS prompt tokens, c0 = c2 = 0) with the weight of one step, so that a few similar
  steps cannot swing it, and kept at 0 or above (no term makes a step cheaper).
cost() is the expected time; the scheduler packs against `bound()`, the expected time of a step
carrying both decodes and prompt tokens times the largest overrun of the last OVERRUN_WINDOW
such steps (actual / cost() of their shapes, priced by the model as it is now, so an overrun
the model has since learned from shrinks) plus that overrun's distance from their median (a
few steps show the spread of step times, not its tail). The largest, not a quantile: every step is one
inter-token gap of every stream it carries, so the streams' ITL p99 is about the step times'
p99, and a target missed by one step in ten is missed at p99. Before MIN_OVERRUNS of them the
factor is PRIOR_OVERRUN: the first mixed steps are priced from scratch forwards and prompt-only
steps, which know neither the decode rows' long contexts nor a small chunk's fixed cost (in a
burst of requests over a long shared prefix, the first mixed step overran its prediction by
up to ~2x and was every request's ITL p99; docs/measurements.md). bound() adds the time
between one step's end and the next one's start while requests wait (scheduling, the sampled
tokens turned into text and sent), which a stream's inter-token gap includes.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

from localrun.engine.spec_control import StepCostModel

WINDOW = 64            # prompt-carrying steps the fit remembers
PRIOR_TOKENS = 64      # the scratch prompt forward that sets the prior per-token cost
OVERRUN_WINDOW = 16    # steps with decodes and prompt tokens whose overruns bound() takes
MIN_OVERRUNS = 4       # such steps seen before bound() trusts their overruns ...
PRIOR_OVERRUN = 2.0    # ... instead of this factor
# features in units that make the coefficients comparable: 1, tokens / 100, keys / 100k
SCALE = np.array([1.0, 100.0, 100_000.0])


def attended_keys(start: int, num_tokens: int) -> int:
    """Keys attended by num_tokens prompt tokens at positions start.. (each q + 1)."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


class MixedStepCost:
    def __init__(self, measure_decode: Callable[[int], float], measure_prompt: Callable[[int], float]):
        """measure_decode(n), measure_prompt(n): seconds of one scratch forward of n decode rows,
        of n prompt tokens (the first estimates, before real steps say more)."""
        self.decode = StepCostModel(measure_decode)
        self.measure_prompt = measure_prompt
        self.steps: deque[tuple[int, int, float]] = deque(maxlen=WINDOW)   # (p, a, seconds less D(d))
        self._prior: np.ndarray | None = None
        self._coefficients: np.ndarray | None = None
        self.mixed: deque[tuple[int, int, int, float]] = deque(maxlen=OVERRUN_WINDOW)  # (d, p, a, seconds)
        self._overrun: float | None = None
        self.between: deque[float] = deque(maxlen=OVERRUN_WINDOW)      # seconds from a step's end to the next
        self.warmed = False

    def warm_up(self, max_decodes: int) -> None:
        """Time now the scratch forwards cost() would otherwise run while scheduling, in the
        middle of serving: decode steps of 1, 2, 4, ... max_decodes rows and the prompt prior.
        Left to the first steps that asked, each new largest decode count and the first prompt
        chunk stalled the engine for a scratch forward (0.85-1.35 s gaps between steps with
        SmolLM2 on 2 cores as 16 requests joined), which became the requests' ITL p99. After it,
        a larger row count (decodes with speculative drafts to verify) is extrapolated, never
        timed in the middle of serving: one such scratch forward stalled a step by 0.21 s."""
        rows = 1
        while rows < max_decodes:
            self.decode.cost(rows)
            rows *= 2
        self.decode.cost(max(1, max_decodes))
        self.coefficients()
        self.warmed = True

    def observe(self, d: int, p: int, a: int, seconds: float) -> None:
        self._overrun = None
        if p == 0:
            self.decode.observe(d, seconds)
            return
        if d:
            self.mixed.append((d, p, a, seconds))
        self.steps.append((p, a, seconds - (self.decode_cost(d) if d else 0.0)))
        self._coefficients = None

    def decode_cost(self, d: int) -> float:
        """D(d); once warmed up, a count past every one known is the line through the two
        largest (rising, if at all), not a scratch forward in the middle of serving."""
        points = self.decode.points() if self.warmed else {}
        if len(points) < 2 or d <= max(points):
            return self.decode.cost(d)
        lo, hi = sorted(points)[-2:]
        return points[hi] + (d - hi) * max(0.0, (points[hi] - points[lo]) / (hi - lo))

    def cost(self, d: int, p: int, a: int) -> float:
        base = self.decode_cost(d) if d else 0.0
        if p == 0:
            return base
        return base + float(self.coefficients() @ (np.array([1.0, p, a]) / SCALE))

    def observe_between(self, seconds: float) -> None:
        """The time from one step's end to the next one's start, the engine busy in between."""
        self.between.append(seconds)

    def bound(self, d: int, p: int, a: int) -> float:
        """The inter-token gap to plan a step with: cost(), times overrun_factor() for a step
        carrying both decodes and prompt tokens (the kind an ITL target packs), plus the median
        time between steps."""
        expected = self.cost(d, p, a)
        return (expected * self.overrun_factor() if d and p else expected) + self.between_s()

    def between_s(self) -> float:
        """The median time between steps (0 before any)."""
        return float(np.median(self.between)) if self.between else 0.0

    def overrun_factor(self) -> float:
        if len(self.mixed) < MIN_OVERRUNS:
            return PRIOR_OVERRUN
        if self._overrun is None:      # until the next step is observed
            ratios = [seconds / self.cost(d, p, a) for d, p, a, seconds in self.mixed]
            # the largest, plus its distance from the median: a few steps show the spread but not
            # its tail, and one step past the target is an inter-token gap of every stream it
            # carries (one 0.154 s step planned at 0.145 made a 150 ms target's ITL p99 0.170 s)
            self._overrun = 2 * max(ratios) - float(np.median(ratios))
        return self._overrun

    def coefficients(self) -> np.ndarray:
        """(c0, c1, c2) in SCALE's units: seconds per step, per 100 tokens, per 100k keys."""
        if self._coefficients is None:
            if self._prior is None:
                per_token = self.measure_prompt(PRIOR_TOKENS) / PRIOR_TOKENS
                self._prior = np.array([0.0, per_token * SCALE[1], 0.0])
            x = np.array([[1.0, p, a] for p, a, _ in self.steps]).reshape(-1, 3) / SCALE
            r = np.array([s for _, _, s in self.steps])
            self._coefficients = nonnegative_ridge(x, r, self._prior)
        return self._coefficients


def nonnegative_ridge(x: np.ndarray, r: np.ndarray, prior: np.ndarray) -> np.ndarray:
    """argmin |x c - r|^2 + |c - prior|^2 over c >= 0: the ridge solution on the coefficients
    still free, those it drives below 0 fixed at 0 one at a time (an active set; three unknowns)."""
    free = np.ones(len(prior), dtype=bool)
    while True:
        c = np.zeros(len(prior))
        xf = x[:, free]
        c[free] = np.linalg.solve(xf.T @ xf + np.eye(free.sum()), xf.T @ r + prior[free])
        if (c >= 0).all():     # all zero at worst: then nothing is free and the loop ends here
            return c
        free[np.argmin(np.where(free, c, np.inf))] = False
