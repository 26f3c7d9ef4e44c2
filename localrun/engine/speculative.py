"""Speculative decoding: a cheap proposer guesses the next k tokens, the target checks them all
in one forward pass, and the engine keeps the longest prefix the target agrees with.

Pieces, in the order a step uses them:
  - proposers: `NgramProposer` (prompt lookup: copy what followed the last n tokens the
    previous time they occurred, no model) and `DraftModelProposer` (engine/draft_model.py);
  - `Speculator.propose()` asks the adaptive controller (engine/spec_control.py) how many
    drafts each decoding sequence should get, and puts them in `seq.draft_token_ids`;
  - the scheduler computes each sequence's last token plus its drafts in one entry; the model
    runner calls `verify_draft()` on those k+1 rows of logits;
  - `Speculator.observe()` feeds the measured step time and each request's acceptance back.

Exactness: at temperature 0 a draft is accepted only if it is the token plain decoding would
pick, so the output is plain decoding's, token for token. At temperature > 0 the standard
rejection rule (accept d with probability min(1, p(d)/q(d)), else draw from the normalized
max(p - q, 0)) makes every emitted token distributed exactly as the target's sampler: p is
the full sampler distribution (penalty, top-k/top-p/min-p, temperature), q the proposer's
(a point mass for prompt lookup).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from localrun.engine.draft_model import DraftKVCache, DraftModelProposer, layer_devices
from localrun.engine.sequence import Sequence, SequenceStatus
from localrun.engine.spec_control import AdaptiveController, StepCostModel
from localrun.errors import OptionError, UserError
from localrun.model.llama import Segment
from localrun.sampling import SamplingParams, probabilities, sample

NGRAM_POLICIES = ("longest", "recent")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str                        # "ngram" (prompt lookup) or "draft" (a draft model)
    num_speculative_tokens: int = 4    # the most drafts per step (llama.cpp's --draft-max)
    adaptive: bool = True              # False: always draft num_speculative_tokens
    ngram_min: int = 2                 # prompt lookup: shortest suffix that may match
    ngram_max: int = 4                 #                longest suffix tried
    ngram_policy: str = "longest"      # "longest" suffix first, or the most "recent" match

    def __post_init__(self):
        if self.method not in ("ngram", "draft"):
            raise UserError(f"Unknown speculative method {self.method!r}; use 'ngram' or a draft model.")
        if not 1 <= self.num_speculative_tokens <= 32:
            raise OptionError("num_speculative_tokens", f"num_speculative_tokens must be between 1 and 32, "
                              f"got {self.num_speculative_tokens}.")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise UserError(f"Need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}.")
        if self.ngram_policy not in NGRAM_POLICIES:
            raise UserError(f"Unknown n-gram policy {self.ngram_policy!r}; choose one of {NGRAM_POLICIES}.")


# --- acceptance ---------------------------------------------------------------------------------
def verify_draft(logits: torch.Tensor, draft: list[int] | tuple[int, ...], draft_probs: torch.Tensor | None,
                 params: SamplingParams, generator: torch.Generator, history: list[int]) -> list[int]:
    """The tokens a verify step keeps: the accepted prefix of `draft`, then one token from the
    target (the correction at the first rejection, or a bonus token after k acceptances).

    logits (k+1, V) float32: row i is the target's next-token logits after history + draft[:i].
    draft_probs (k, V): the distribution each draft token was drawn from; None means the
    proposer is deterministic (a point mass on the draft). history: the sequence's tokens,
    for the repetition penalty, as plain sampling sees them.
    """
    assert logits.shape[0] == len(draft) + 1
    kept: list[int] = []
    for i, token in enumerate(draft):
        recent = history + kept
        if params.greedy:             # plain decoding's own choice; accept if the draft made it
            choice = sample(logits[i], params, generator, recent)
            kept.append(choice)
            if choice != token:
                return kept
            continue
        p = probabilities(logits[i], params, recent)
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[token] = 1.0
        else:
            q = draft_probs[i].to(p.dtype)
        if float(torch.rand((), generator=generator)) * float(q[token]) < float(p[token]):
            kept.append(token)        # accepted with probability min(1, p/q)
            continue
        residual = (p - q).clamp_min_(0.0)
        if float(residual.sum()) <= 0.0:    # p == q up to rounding: any draw from p is exact
            residual = p
        kept.append(int(torch.multinomial(residual, 1, generator=generator)))
        return kept
    kept.append(sample(logits[len(draft)], params, generator, history + kept))
    return kept


# --- prompt lookup ------------------------------------------------------------------------------
@dataclass(frozen=True)
class NgramProposer:
    """Prompt lookup decoding: find an earlier occurrence of the sequence's last n tokens (in the
    prompt or the generated text) and propose the tokens that followed it.
    policy "longest": the longest suffix (ngram_max down to ngram_min) that occurs earlier, its
    most recent occurrence; "recent": the most recent occurrence of any suffix of ngram_min or
    more tokens. Deterministic, so verify_draft treats each draft as a point mass."""
    ngram_min: int = 2
    ngram_max: int = 4
    policy: str = "longest"

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        tokens = np.asarray(token_ids, dtype=np.int64)
        L = len(tokens)
        sizes = range(min(self.ngram_max, L - 1), self.ngram_min - 1, -1)
        if self.policy == "recent":
            sizes = [self.ngram_min] if self.ngram_min <= L - 1 else []
        for n in sizes:
            # starts i < L - n where tokens[i:i+n] equals the last n tokens
            match = tokens[:L - n] == tokens[L - n]
            for j in range(1, n):
                match &= tokens[j:L - n + j] == tokens[L - n + j]
            starts = np.flatnonzero(match)
            if len(starts):
                i = int(starts[-1]) + n
                return tokens[i:i + k].tolist()
        return []


def measure_forward_seconds(model, num_tokens: int, context: int = 32, repeats: int = 3,
                            rowwise: bool = False) -> float:
    """Seconds of one forward of num_tokens tokens after `context` cached ones, on a scratch
    cache (the best of `repeats`, after a warm-up): the controller's first estimate of a step
    size it has not seen yet. rowwise: rows as a verify step computes them: each attends on its
    own and goes through the weights as a decode row (the integer kernel; as prompt rows with
    prompt_math float32 they take the float path, which at 5 rows measured twice the engine's
    real verify step, and the controller then never drafted the k it had priced so)."""
    c = model.config
    asked, max_positions = num_tokens, model.freqs.shape[0]
    num_tokens = min(num_tokens, max_positions - 1)    # a model with fewer positions than asked:
    context = min(context, max_positions - num_tokens)  # time what fits, scale (about linear)
    cache = DraftKVCache(c.n_layers, c.n_head_kv, c.head_dim, model.dtype, capacity=context + num_tokens,
                         devices=layer_devices(model))
    device = model.tok_embeddings.device
    ids = torch.arange(context + num_tokens, device=device) % c.n_vocab
    positions = torch.arange(context + num_tokens, device=device)
    model(ids[:context], positions[:context], [Segment(0, context, 0, cache)], positions[:1])
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        model(ids[context:], positions[context:], [Segment(0, num_tokens, context, cache, rowwise)],
              torch.arange(num_tokens, device=device), decode_rows=num_tokens if rowwise else 0)
        best = min(best, time.perf_counter() - start)
    return best * asked / num_tokens


# --- the engine's side --------------------------------------------------------------------------
class Speculator:
    """Drafts for the decoding sequences before each step, and learns from each step after it.

    target_forward_cost(T) -> seconds and draft_forward_cost(B) -> seconds time one forward of
    T tokens of the target (B rows of the draft model) on scratch caches: the adaptive
    controller calls them only for batch sizes it has not seen, then learns from real steps."""

    def __init__(self, config: SpeculativeConfig, *, max_model_len: int,
                 target_forward_cost, draft_proposer=None, draft_forward_cost=None):
        if config.method == "draft" and draft_proposer is None:
            raise UserError("Speculative method 'draft' needs a draft model.")
        self.config = config
        self.max_model_len = max_model_len
        self.ngram = NgramProposer(config.ngram_min, config.ngram_max, config.ngram_policy)
        self.draft = draft_proposer
        draft_cost = StepCostModel(draft_forward_cost) if draft_forward_cost is not None else None
        self.controller = AdaptiveController(config.num_speculative_tokens, StepCostModel(target_forward_cost),
                                             draft_cost, adaptive=config.adaptive)
        self.num_proposals = 0          # steps that drafted for at least one sequence

    def warm_up(self) -> None:
        """Measure what a lone request's first decision needs (a plain step, a full verify
        step, one draft forward) now, at start-up, rather than inside its first decode step."""
        if self.config.adaptive:
            self.controller.target_cost.cost(1)
            self.controller.target_cost.cost(1 + self.config.num_speculative_tokens)
            if self.controller.draft_cost is not None:
                self.controller.draft_cost.cost(1)

    def _eligible(self, seq: Sequence) -> bool:
        params = seq.sampling_params
        return (seq.status is SequenceStatus.RUNNING and not seq.is_prefill
                and (params is None or params.speculative))

    def _limit(self, seq: Sequence) -> int:
        """Drafts that can matter: within the context and before max_tokens."""
        limit = self.max_model_len - seq.num_tokens
        params = seq.sampling_params
        if params is not None and params.max_tokens is not None:
            limit = min(limit, params.max_tokens - seq.num_generated_tokens - 1)
        return limit

    def propose(self, running: list[Sequence]) -> None:
        """Set draft_token_ids (and draft_probs) on the running sequences worth drafting for."""
        decodes = [s for s in running if s.status is SequenceStatus.RUNNING and not s.is_prefill]
        candidates = [s for s in decodes if self._eligible(s) and self._limit(s) > 0]
        if not candidates:
            return
        # prompt chunks in the same step are left out of the base: that only makes drafting
        # look costlier than it is (and spares timing a forward of a whole chunk)
        caps = self.controller.plan([s.request_id for s in candidates], [self._limit(s) for s in candidates],
                                    num_decodes=len(decodes), base_tokens=len(decodes))
        wanted = [(s, k) for s, k in zip(candidates, caps) if k > 0]
        if not wanted:
            return
        start = time.perf_counter()
        if self.config.method == "ngram":
            for seq, k in wanted:
                seq.draft_token_ids, seq.draft_probs = self.ngram.propose(seq.token_ids, k), None
            self.controller.observe_ngram(time.perf_counter() - start)
        else:
            drafts = self.draft.propose(wanted)
            for (seq, _), (tokens, probs) in zip(wanted, drafts):
                seq.draft_token_ids, seq.draft_probs = tokens, probs
            self.controller.observe_draft(len(wanted), max(k for _, k in wanted), time.perf_counter() - start)
        if any(seq.draft_token_ids for seq, _ in wanted):
            self.num_proposals += 1

    def observe(self, batch, execute_seconds: float) -> None:
        """After postprocess(): the step's cost and what each verifying sequence kept."""
        if batch.entries and not any(e.is_prefill for e in batch.entries):
            self.controller.observe_step(batch.num_batched_tokens, execute_seconds)
        for entry in batch.entries:
            if entry.num_draft_tokens and entry.output_token_ids:
                self.controller.observe_acceptance(entry.seq.request_id, entry.num_draft_tokens,
                                                   len(entry.output_token_ids) - 1)

    def release(self, seq: Sequence) -> None:
        self.controller.release(seq.request_id)
        if self.draft is not None:
            self.draft.release(seq.request_id)

    def stats(self) -> dict[str, float | int]:
        return {"spec_proposal_steps": self.num_proposals, **self.controller.stats()}


def make_speculator(config: SpeculativeConfig, model, *, max_model_len: int, draft_model=None) -> Speculator:
    """The Speculator an LLMEngine runs: prompt lookup, or a draft model (its own Transformer,
    or `draft_model.self_draft(model, n)`), with costs measured on this machine's models."""
    if config.method == "draft" and draft_model is None:
        raise UserError("Speculative method 'draft' needs a draft model.")
    if config.method == "draft" and draft_model.config.n_vocab != model.config.n_vocab:
        raise UserError(f"The draft model has {draft_model.config.n_vocab} tokens but the target has "
                        f"{model.config.n_vocab}; a draft model needs the same vocabulary.")
    proposer = DraftModelProposer(draft_model) if config.method == "draft" else None
    speculator = Speculator(config, max_model_len=max_model_len,
                            target_forward_cost=lambda t: measure_forward_seconds(model, t, rowwise=True),
                            draft_proposer=proposer,
                            draft_forward_cost=(lambda b: measure_forward_seconds(draft_model, b)) if proposer else None)
    speculator.warm_up()
    return speculator
