"""When speculation pays, measured: step costs on this machine and each request's acceptance.

Speculation pays when the tokens a verify step yields outweigh what it costs over a plain
step. With a per-draft acceptance rate a and k drafts, a verify step yields on average
E(a, k) = 1 + a + ... + a^k tokens (drafts are accepted up to the first rejection), and costs
cost(T + k) + draft_cost(k) against cost(T) for a plain step over T tokens. Both costs are
measured, never assumed: `StepCostModel` times real steps (and, for a batch size it has not
seen, one scratch forward), because the ratio depends on the hardware, the weight format and
the batch: on a memory-bound CPU decode a few more rows are almost free, while a busy batch is
compute-bound and every drafted row costs about as much as a real token.

A request's acceptance is only known once it has drafted, so a request with no verify step
yet (new, or back from a cool-down) starts from a neutral prior (half of one draft
accepted). Where that prior already pays (a GPU, where extra rows are almost free) it drafts
the prior's best k. Where it does not, it probes: it drafts the fewest tokens whose best case
(all accepted) pays, usually 1, and that verify step's evidence decides from then on; k
grows as the acceptance does. Planning from the prior alone would never draft wherever a
verify step costs more than 1.9x a plain one: no evidence could ever overturn it. That is
the case wherever the matmuls are compute-bound at a few rows: if, say, each extra row costs
0.48x a plain step (5 rows: 2.9x one), a failed probe of 4 drafts costs ~1.9 plain steps and
one of 1 draft ~0.4.

Two switches follow from it:
  - per request: if even the best k gives an expected speedup below 1 alone, the request stops
    drafting for a cool-down (8, 16, 32, 64 steps; back to 8 after a step that accepts every
    draft), then tries again as a new request;
  - per step (global): the controller picks one cap k for the whole batch by expected
    throughput, and 0 (no drafting at all) when the batch is busy enough that verification
    costs more than it saves. It is re-decided every step, so it comes back when it pays again.
Torch-free, like the scheduler.
"""
from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

PRIOR_ACCEPTED, PRIOR_TRIALS = 0.5, 1.0   # a neutral start: acceptance 0.5, weight of one draft
DECAY = 0.9                               # per verify step: recent behaviour counts most
COOLDOWN_MIN, COOLDOWN_MAX = 8, 64        # steps a request that did not pay stops drafting
WINDOW = 9                                # step times kept per token count (median: robust to noise)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a verify step with k drafts yields on average: 1 + a + a^2 + ... + a^k."""
    return sum(acceptance ** i for i in range(k + 1))


class StepCostModel:
    """Seconds of one forward over T tokens, as measured: the median of the last few real steps
    of each size, linear interpolation between sizes, and for a size beyond them a scratch
    forward (`measure`) scaled to the real steps.

    A scratch forward runs on a cache of its own, outside the engine's fused paths, so its level
    is not the engine's while its growth with T is (a one-row scratch forward took well over a
    real step's time). Taken as a real sample, it priced a 5-row verify step at about twice its
    measured ratio to a plain one, so the controller never drafted 4 tokens and no real step
    could correct it (docs/measurements.md). So a scratch size counts at the real level: scaled by real / scratch at
    the nearest size measured both ways (a size real steps have shown is measured in scratch
    once for that, when none is yet)."""

    def __init__(self, measure: Callable[[int], float]):
        self.measure = measure
        self.samples: dict[int, deque[float]] = {}     # real steps, per token count
        self.scratch: dict[int, float] = {}            # scratch forwards, per token count

    def observe(self, num_tokens: int, seconds: float) -> None:
        self.samples.setdefault(num_tokens, deque(maxlen=WINDOW)).append(seconds)

    def cost(self, num_tokens: int) -> float:
        if num_tokens in self.samples:
            return statistics.median(self.samples[num_tokens])
        points = self.points()
        if not points or num_tokens > max(points) or (num_tokens < min(points) and num_tokens == 1):
            self.scratch[num_tokens] = self.measure(num_tokens)
            if self.samples and not self.scratch.keys() & self.samples.keys():    # the scale's anchor
                near = min(self.samples, key=lambda r: (abs(r - num_tokens), r))
                self.scratch[near] = self.measure(near)
            points = self.points()
            return points[num_tokens]
        if num_tokens in points:
            return points[num_tokens]
        known = sorted(points)
        if num_tokens < known[0]:
            return points[known[0]]
        hi = next(t for t in known if t > num_tokens)
        lo = max(t for t in known if t < num_tokens)
        return points[lo] + (points[hi] - points[lo]) * (num_tokens - lo) / (hi - lo)

    def points(self) -> dict[int, float]:
        """Seconds per token count: the real steps' medians, and the scratch forwards of other
        sizes scaled by real / scratch at the nearest size measured both ways (measures nothing)."""
        real = {t: statistics.median(v) for t, v in self.samples.items()}
        anchors = [t for t in real if t in self.scratch]
        points = dict(real)
        for t, seconds in self.scratch.items():
            if t in real:
                continue
            if anchors:
                near = min(anchors, key=lambda r: (abs(r - t), r))
                seconds *= real[near] / self.scratch[near]
            points[t] = seconds
        return points


@dataclass
class RequestState:
    accepted: float = PRIOR_ACCEPTED       # decayed count of accepted drafts
    trials: float = PRIOR_TRIALS           # decayed count of drafts judged (accepted or first rejected)
    off_steps: int = 0                     # steps left without drafting
    cooldown: int = COOLDOWN_MIN           # the next cool-down's length
    judged: bool = False                   # has a verify step since it started (or restarted)?

    @property
    def acceptance(self) -> float:
        return self.accepted / self.trials

    @property
    def planning_acceptance(self) -> float:
        """What a batch's plan assumes: the evidence, or before any, the best case, so that
        a probe (see the module doc) is not planned away."""
        return self.acceptance if self.judged else 1.0


class AdaptiveController:
    """Chooses each step's draft lengths from measured costs and per-request acceptance."""

    def __init__(self, max_k: int, target_cost: StepCostModel, draft_cost: StepCostModel | None = None,
                 *, adaptive: bool = True):
        self.max_k = max_k
        self.target_cost = target_cost
        self.draft_cost = draft_cost       # per draft-model forward over B rows; None: prompt lookup
        self.adaptive = adaptive
        self.requests: dict[str, RequestState] = {}
        self.ngram_seconds = 0.0           # prompt lookup's own cost per step (moving average)
        self.num_steps_planned = 0
        self.num_steps_off = 0             # steps where the batch was too busy to speculate
        self.num_request_cooldowns = 0
        self.last_cap = 0

    # --- costs ----------------------------------------------------------------------------
    def _draft_seconds(self, num_rows: int, k: int) -> float:
        if self.draft_cost is None:
            return self.ngram_seconds
        return k * self.draft_cost.cost(num_rows)

    def _speedup_alone(self, acceptance: float, k: int) -> float:
        plain = self.target_cost.cost(1)
        return expected_tokens(acceptance, k) * plain / (self.target_cost.cost(1 + k) + self._draft_seconds(1, k))

    # --- one step -------------------------------------------------------------------------
    def plan(self, request_ids: list[str], limits: list[int], *, num_decodes: int, base_tokens: int) -> list[int]:
        """Draft length for each candidate request (0: none this step). limits: the most drafts
        that can matter for each (context, max_tokens); num_decodes: decoding sequences this
        step; base_tokens: tokens the step computes without any draft."""
        self.num_steps_planned += 1
        if not self.adaptive:
            self.last_cap = self.max_k
            return [min(self.max_k, limit) for limit in limits]
        caps, acceptances = [], []
        for request_id, limit in zip(request_ids, limits):
            state = self.requests.setdefault(request_id, RequestState())
            caps.append(self._request_cap(state, min(limit, self.max_k)))
            acceptances.append(state.planning_acceptance)
        plain = num_decodes / self.target_cost.cost(base_tokens)     # tokens per second
        best_cap, best = 0, plain
        for cap in range(1, max(caps, default=0) + 1):
            ks = [min(cap, c) for c in caps]
            drafting = sum(1 for k in ks if k)
            tokens = num_decodes - len(ks) + sum(expected_tokens(a, k) for a, k in zip(acceptances, ks))
            seconds = self.target_cost.cost(base_tokens + sum(ks)) + self._draft_seconds(drafting, cap)
            if tokens / seconds > best:
                best_cap, best = cap, tokens / seconds
        if best_cap == 0 and any(caps):
            self.num_steps_off += 1
        self.last_cap = best_cap
        return [min(best_cap, c) for c in caps]

    def _request_cap(self, state: RequestState, limit: int) -> int:
        """The request's best k alone, or 0 while it cools down after not paying."""
        if state.off_steps > 0:
            state.off_steps -= 1
            if state.off_steps == 0:           # try again, as a new request
                state.accepted, state.trials, state.judged = PRIOR_ACCEPTED, PRIOR_TRIALS, False
            return 0
        if limit <= 0:
            return 0
        best_k, best = 0, 1.0
        for k in range(1, limit + 1):
            speedup = self._speedup_alone(state.acceptance, k)
            if speedup > best:
                best_k, best = k, speedup
        if best_k == 0 and not state.judged:   # a probe: the cheapest draft that could pay
            return next((k for k in range(1, limit + 1) if self._speedup_alone(1.0, k) > 1), 0)
        if best_k == 0:
            state.off_steps, state.cooldown = state.cooldown, min(2 * state.cooldown, COOLDOWN_MAX)
            self.num_request_cooldowns += 1
        return best_k

    # --- feedback -------------------------------------------------------------------------
    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A decode-only step (verifying or plain) took seconds over num_tokens tokens."""
        self.target_cost.observe(num_tokens, seconds)

    def observe_draft(self, num_rows: int, k: int, seconds: float) -> None:
        """The draft model drafted k tokens for num_rows sequences in `seconds` (k forwards)."""
        if self.draft_cost is not None and k > 0:
            self.draft_cost.observe(num_rows, seconds / k)

    def observe_ngram(self, seconds: float) -> None:
        self.ngram_seconds = 0.8 * self.ngram_seconds + 0.2 * seconds

    def observe_acceptance(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """k drafts were verified and the first num_accepted accepted: that is num_accepted
        successes out of num_accepted + 1 trials (the first rejection), or k out of k."""
        state = self.requests.setdefault(request_id, RequestState())
        trials = num_accepted + (1 if num_accepted < num_drafts else 0)
        state.accepted = DECAY * state.accepted + num_accepted
        state.trials = DECAY * state.trials + trials
        state.judged = True
        if num_accepted == num_drafts:      # a full hit: the text may have turned repetitive
            state.cooldown = COOLDOWN_MIN

    def release(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def stats(self) -> dict[str, float | int]:
        target = self.target_cost
        points, ratio = target.points(), None
        if 1 in points and (1 + self.max_k) in points:
            ratio = points[1 + self.max_k] / points[1]
        return {
            "spec_enabled": int(self.last_cap > 0),
            "spec_steps_planned": self.num_steps_planned,
            "spec_steps_off_busy": self.num_steps_off,
            "spec_request_cooldowns": self.num_request_cooldowns,
            "spec_requests_cooling_down": sum(1 for s in self.requests.values() if s.off_steps > 0),
            **({"spec_verify_cost_ratio": ratio} if ratio is not None else {}),
        }
