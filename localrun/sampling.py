"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, min-p,
repetition penalty, seeded. The order of the filters follows llama.cpp's default chain
(penalties -> top-k -> top-p -> min-p -> temperature -> draw)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from localrun.errors import UserError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.8        # <= 0 means greedy
    top_k: int = 40                 # <= 0 disables
    top_p: float = 0.95             # >= 1 disables
    min_p: float = 0.05             # <= 0 disables
    repeat_penalty: float = 1.0     # 1 disables; llama.cpp's rule over the last repeat_last_n tokens
    repeat_last_n: int = 64
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    speculative: bool = True        # False: never draft for this request, even when the engine speculates

    def __post_init__(self):
        if self.max_tokens < 0:
            raise UserError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 <= self.top_p <= 1:
            raise UserError(f"top_p must be between 0 and 1, got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise UserError(f"min_p must be between 0 and 1, got {self.min_p}")
        if self.repeat_penalty <= 0:
            raise UserError(f"repeat_penalty must be > 0, got {self.repeat_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else torch.seed() % (2 ** 63))
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
    """Mask with -inf everything top-k, top-p and min-p drop. logits (V,) float32."""
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens before it already reach top_p (always keep the first)
        drop_sorted = (probs.cumsum(-1) - probs) >= p.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def probabilities(logits: torch.Tensor, p: SamplingParams,
                  recent: list[int] | tuple[int, ...] = ()) -> torch.Tensor:
    """The distribution `sample` draws from, (V,) float32: what speculative decoding's
    rejection rule compares a draft against. Greedy: one-hot at the argmax."""
    logits = _penalized(logits, p, recent)
    if p.greedy:
        return torch.zeros_like(logits).index_fill_(0, logits.argmax().view(1), 1.0)
    return _filtered_probs(logits, p)


def sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator,
           recent: list[int] | tuple[int, ...] = ()) -> int:
    """One token id from next-token logits (V,) float32."""
    logits = _penalized(logits, p, recent)
    if p.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(_filtered_probs(logits, p), 1, generator=generator))


def _penalized(logits: torch.Tensor, p: SamplingParams, recent) -> torch.Tensor:
    if p.repeat_penalty != 1.0 and p.repeat_last_n:   # only then look at the history (per token)
        logits = apply_repeat_penalty(logits, list(recent[-p.repeat_last_n:]), p.repeat_penalty)
    return logits


def _filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    return (filter_logits(logits, p) / p.temperature).softmax(-1)
