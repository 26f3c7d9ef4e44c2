"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, min-p,
repetition penalty, OpenAI's presence and frequency penalties, logit bias, a grammar's token
mask, logprobs, seeded. The order follows llama.cpp's default chain:
logit bias -> penalties -> grammar mask -> [logprobs] -> top-k -> top-p -> min-p -> temperature -> draw,
with min_tokens' ban of the end-of-generation tokens beside the logit bias (llama-cpp-python's
min-tokens processor; vLLM's min_tokens).

logprobs are the log-softmax of the logits after logit_bias, the penalties and the grammar
mask, before temperature and the top-k/top-p/min-p truncation: the model's distribution as
the request shaped it, the same at any temperature (greedy included), and never -inf for a
token that truncation alone dropped.

A sequence's mutable sampler state (`SamplerState`: where its output starts, its grammar
matcher, its recorded logprobs) rides on its own copy of the params (`state`), which the
engine attaches when the sequence is added."""
from __future__ import annotations

import torch

from localrun import kernels
from localrun.sampling_params import (  # noqa: F401  (re-exported: the sampler's callers import them here)
    MAX_TOP_LOGPROBS, MIN_TEMPERATURE, SEED_MODULUS, InvalidSamplingParam, SamplingParams, TokenLogprob)


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed % SEED_MODULUS if seed is not None else torch.seed() % (2 ** 63))
    return g


def apply_repeat_penalty(logits: torch.Tensor, recent: list[int], penalty: float) -> torch.Tensor:
    """llama.cpp's rule: a seen token's logit is divided by the penalty when positive,
    multiplied when negative (each distinct token once)."""
    if penalty == 1.0 or not recent:
        return logits
    ids = torch.tensor(sorted(set(recent)), dtype=torch.long)
    seen = logits[ids]
    logits = logits.clone()
    logits[ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Mask with -inf everything top-k, top-p and min-p drop. logits (V,) float32. The
    full-width reference of `candidate_probs`, which the sampler uses (tests compare the two)."""
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens before it already reach top_p (always keep the first)
        drop_sorted = (probs.cumsum(-1) - probs) >= p.top_p
        drop_sorted[0] = False     # even when top_p rounds to 0 in float32
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


class SamplerState:
    """One sequence's sampling state: the number of prompt tokens (the penalties count the
    output only), its grammar matcher, kept in step with the sequence's tokens, and the
    logprobs recorded for each sampled token until the engine reports them."""

    def __init__(self, num_prompt_tokens: int, matcher=None, banned_early: tuple[int, ...] = ()):
        self.num_prompt_tokens = num_prompt_tokens
        self.matcher = matcher
        self.banned_early = banned_early    # ids banned until min_tokens are generated: the engine's EOG ids
        self.num_consumed = 0           # output tokens the matcher has consumed
        self.logprobs: list[TokenLogprob] = []

    def output(self, recent) -> list[int]:
        return list(recent[self.num_prompt_tokens:])

    def sync(self, recent) -> None:
        """Hand the matcher the output tokens it has not seen (sampled since the last call): it
        consumes them and computes the next mask on the grammar thread (grammar.Matcher)."""
        if self.matcher is None:
            return
        new = self.output(recent)[self.num_consumed:]
        if new:
            self.matcher.advance(new)
            self.num_consumed += len(new)

    def ready(self) -> bool:
        """Nothing to wait for before this sequence's next token can be sampled."""
        return self.matcher is None or self.matcher.ready()

    def wait(self, timeout: float | None = None) -> None:
        if self.matcher is not None:
            self.matcher.wait(timeout)

    def take_logprob(self) -> TokenLogprob | None:
        return self.logprobs.pop(0) if self.logprobs else None


def argmax(logits: torch.Tensor) -> int:
    """The index of the largest logit (the first one on ties, a NaN's if any), as torch's argmax:
    on the CPU through numpy's, an order of magnitude faster over a vocabulary (docs/measurements.md)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return int(logits.numpy().argmax())
    return int(logits.argmax())


def probabilities(logits: torch.Tensor, p: SamplingParams,
                  recent: list[int] | tuple[int, ...] = ()) -> torch.Tensor:
    """The distribution `sample` draws from, (V,) float32: what speculative decoding's
    rejection rule compares a draft against. Greedy: one-hot at the argmax."""
    logits = _penalized(logits, p, recent)
    if p.greedy:
        return torch.zeros_like(logits).index_fill_(0, torch.tensor([argmax(logits)], device=logits.device), 1.0)
    return _filtered_probs(logits, p)


def sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator,
           recent: list[int] | tuple[int, ...] = ()) -> int:
    """One token id from next-token logits (V,) float32. `recent`: the sequence's tokens so far
    (prompt and output), for the penalties and the grammar."""
    state = p.state
    grammar = state is not None and state.matcher is not None
    if grammar:
        state.sync(recent)
    logits = _penalized(logits, p, recent, ban_early=not (grammar and _grammar_must_end(p, recent)))
    if grammar:
        logits = state.matcher.mask(logits)
    if p.greedy:
        token_id = argmax(logits)
    else:
        ids, probs = candidate_probs(logits, p)
        token_id = int(ids[torch.multinomial(probs, 1, generator=generator)])
    if state is not None and p.logprobs is not None:
        state.logprobs.append(token_logprob(logits, token_id, p.logprobs))
    return token_id


def plain_greedy(p: SamplingParams) -> bool:
    """Whether `sample` is the argmax of the logits as they come, whatever the sequence's tokens:
    greedy, and nothing of `sample`'s chain changes a logit (logit bias, min_tokens' ban, the
    penalties, a grammar) or records one (logprobs). The engine takes such rows' argmax without
    the chain (ModelRunner.sample). Keep in step with `sample` and `_penalized`."""
    state = p.state
    return (p.greedy and not p.logit_bias and not p.min_tokens and (p.repeat_penalty == 1.0 or not p.repeat_last_n)
            and not p.presence_penalty and not p.frequency_penalty and p.logprobs is None
            and (state is None or state.matcher is None))


def token_logprob(logits: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    """The sampled token's logprob and the top k, from processed logits (V,): ties ranked by id."""
    logprobs = torch.log_softmax(logits.double(), -1).float()
    top = []
    if k:
        values, ids = torch.topk(logprobs, min(k, logprobs.shape[0]))
        top = [(int(i), float(v)) for v, i in zip(values.tolist(), ids.tolist())]
    return TokenLogprob(token_id, float(logprobs[token_id]), top)


def _bans_early(p: SamplingParams, recent) -> bool:
    """min_tokens still bans the end-of-generation tokens."""
    state = p.state
    return bool(p.min_tokens and state is not None and state.banned_early
                and len(recent) - state.num_prompt_tokens < p.min_tokens)


def _grammar_must_end(p: SamplingParams, recent) -> bool:
    """The grammar allows nothing but end-of-generation tokens that min_tokens still bans: the
    grammar's end wins (a reply cannot hold both; without this every logit would be -inf)."""
    if not _bans_early(p, recent):
        return False
    allowed = p.state.matcher.allowed().clone()
    allowed[[t for t in p.state.banned_early if t < allowed.shape[0]]] = False
    return not allowed.any()


def _penalized(logits: torch.Tensor, p: SamplingParams, recent, ban_early: bool = True) -> torch.Tensor:
    state = p.state
    if ban_early and _bans_early(p, recent):
        logits = logits.index_fill(0, torch.tensor(state.banned_early, dtype=torch.long), float("-inf"))
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long)
        logits = logits.index_add(0, ids, torch.tensor([b for _, b in p.logit_bias], dtype=logits.dtype))
    if p.repeat_penalty != 1.0 and p.repeat_last_n:   # only then look at the history (per token)
        logits = apply_repeat_penalty(logits, list(recent[-p.repeat_last_n:]), p.repeat_penalty)
    if (p.presence_penalty or p.frequency_penalty) and p.state is not None:
        logits = apply_openai_penalties(logits, p.state.output(recent), p.presence_penalty, p.frequency_penalty)
    return logits


def apply_openai_penalties(logits: torch.Tensor, output: list[int], presence: float,
                           frequency: float) -> torch.Tensor:
    """OpenAI's rule over the tokens generated so far (not the prompt), with c[j] the count of
    token j: logit[j] -= c[j] * frequency + (c[j] > 0) * presence."""
    if not output or (presence == 0 and frequency == 0):
        return logits
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[0])[:logits.shape[0]]
    counts = counts.to(logits.dtype)
    return logits - counts * frequency - (counts > 0).to(logits.dtype) * presence


def _filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution over the whole vocabulary (V,): the candidates' probabilities in place."""
    ids, probs = candidate_probs(logits, p)
    return torch.zeros_like(logits).index_copy_(0, ids, probs)


def _topk(logits: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(logits, n); a float32 row on the CPU goes through the compiled one-pass kernel
    (kernels.topk: the same values and, but for ties, the same ids; ties lowest index first),
    several times faster than torch.topk inside a decode step (docs/measurements.md)."""
    if logits.dim() == 1 and logits.dtype == torch.float32 and logits.device.type == "cpu" and kernels.available():
        return kernels.topk(logits, n)
    return torch.topk(logits, n)


def candidate_probs(logits: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, probabilities) of the tokens top-k, top-p and min-p keep, at the temperature: the
    distribution of softmax(filter_logits(logits, p) / temperature), computed over top-k's
    candidates only (every token tied with the k-th included, as filter_logits keeps them), as
    llama.cpp's sampler chain does. Over a 49k vocabulary the full-width chain (a sort, three
    softmaxes, a draw over all V) took a quarter of a decode step (docs/measurements.md)."""
    values = ids = kth = None
    k = p.top_k
    if 0 < k < logits.shape[-1]:
        values, ids = _topk(logits, k + 1)                         # in descending order, one past the k-th
        kth = values[k - 1]
        if values[k] == kth:                                       # others tie with the k-th: keep them too
            values = ids = None
        else:
            values, ids = values[:k], ids[:k]
            if kth == float("-inf"):         # a masked token (grammar, bias) has probability 0 anyway
                ids, values = ids[values > float("-inf")], values[values > float("-inf")]
    if ids is None:
        keep = logits > float("-inf")
        if kth is not None:
            keep &= logits >= kth
        ids = keep.nonzero().flatten()
        values, order = torch.sort(logits[ids], descending=True)
        ids = ids[order]
    if ids.numel() == 0:       # nothing finite, or a NaN k-th value: the whole vocabulary, as filter_logits
        ids = torch.arange(logits.shape[-1], device=logits.device)
        values, order = torch.sort(logits, descending=True)
        ids = ids[order]
    if p.top_p < 1.0:       # as filter_logits: drop a token once those before it reach top_p
        probs = values.softmax(-1)
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        drop[0] = False
        values = values.masked_fill(drop, float("-inf"))
    if p.min_p > 0.0:
        probs = values.softmax(-1)
        values = values.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return ids, (values / max(p.temperature, MIN_TEMPERATURE)).softmax(-1)
