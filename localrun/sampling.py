"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, min-p,
repetition penalty, OpenAI's presence and frequency penalties, logit bias, a grammar's token
mask, logprobs, seeded. The order follows llama.cpp's default chain:
logit bias -> penalties -> grammar mask -> [logprobs] -> top-k -> top-p -> min-p -> temperature -> draw.

logprobs are the log-softmax of the logits after logit_bias, the penalties and the grammar
mask, before temperature and the top-k/top-p/min-p truncation: the model's distribution as
the request shaped it, the same at any temperature (greedy included), and never -inf for a
token that truncation alone dropped.

A sequence's mutable sampler state (`SamplerState`: where its output starts, its grammar
matcher, its recorded logprobs) rides on its own copy of the params (`state`), which the
engine attaches when the sequence is added."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from localrun.errors import UserError


class InvalidSamplingParam(UserError, ValueError):
    """A sampling field out of its range; `field` names it (the server's 400 carries it)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


# The ranges, OpenAI's where OpenAI defines the field. repeat_penalty (llama.cpp's) divides
# logits: outside [0.01, 10] it overflows float32 logits or stops meaning anything.
TEMPERATURE_RANGE = (0.0, 2.0)
REPEAT_PENALTY_RANGE = (0.01, 10.0)
MIN_TEMPERATURE = 1e-6      # a positive temperature below this samples as this (float32 would overflow)
SEED_MODULUS = 2 ** 64      # torch generators take a 64-bit seed; any integer is mapped into it
LOGIT_BIAS_RANGE = (-100.0, 100.0)     # OpenAI's; -100 bans a token, 100 all but forces it
MAX_LOGIT_BIAS_TOKENS = 1024
PENALTY_RANGE = (-2.0, 2.0)            # OpenAI's presence_penalty and frequency_penalty
MAX_TOP_LOGPROBS = 20                  # OpenAI's bound on top_logprobs


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.8        # 0 means greedy; at most 2
    top_k: int = 40                 # 0 disables
    top_p: float = 0.95             # in (0, 1]; 1 disables
    min_p: float = 0.05             # in [0, 1]; 0 disables
    repeat_penalty: float = 1.0     # 1 disables; llama.cpp's rule over the last repeat_last_n tokens
    repeat_last_n: int = 64
    seed: int | None = None         # any integer (taken modulo 2**64)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit); a dict is accepted
    speculative: bool = True        # False: never draft for this request, even when the engine speculates
    presence_penalty: float = 0.0   # OpenAI's: subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the output
    logprobs: int | None = None     # None: none; k: the sampled token's logprob and the k most likely (k <= 20)
    constraint: object = None       # a grammar.Constraint (JSON schema, grammar): tokens outside it are masked
    state: object = field(default=None, compare=False, repr=False)   # SamplerState, per sequence (engine)

    def __post_init__(self):
        _integer("max_tokens", self.max_tokens, low=0)
        _number("temperature", self.temperature, *TEMPERATURE_RANGE)
        _integer("top_k", self.top_k, low=0)
        _number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _number("min_p", self.min_p, 0.0, 1.0)
        _number("repeat_penalty", self.repeat_penalty, *REPEAT_PENALTY_RANGE)
        _integer("repeat_last_n", self.repeat_last_n, low=0)
        if self.seed is not None:
            _integer("seed", self.seed)
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidSamplingParam("stop", "stop must be a sequence of non-empty strings")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        _number("presence_penalty", self.presence_penalty, *PENALTY_RANGE)
        _number("frequency_penalty", self.frequency_penalty, *PENALTY_RANGE)
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, low=0)
            if self.logprobs > MAX_TOP_LOGPROBS:
                raise InvalidSamplingParam("logprobs", f"logprobs (top_logprobs) must be at most {MAX_TOP_LOGPROBS}, "
                                                       f"got {self.logprobs}")

    @property
    def needs_state(self) -> bool:
        """True when sampling needs per-sequence state (output counts, a matcher, logprobs)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.logprobs is not None
                or self.constraint is not None)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def _logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """Sorted (token id, bias) pairs from a dict or pairs; ids are checked against the
    vocabulary where it is known (the engine, the server)."""
    pairs = list(bias.items()) if isinstance(bias, dict) else list(bias)
    if len(pairs) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidSamplingParam("logit_bias", f"logit_bias may bias at most {MAX_LOGIT_BIAS_TOKENS} tokens, "
                                                 f"got {len(pairs)}")
    out = {}
    for pair in pairs:
        token_id, value = pair if isinstance(pair, (tuple, list)) and len(pair) == 2 else (None, None)
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise InvalidSamplingParam("logit_bias", f"logit_bias keys must be token ids, got {token_id!r}")
        _number("logit_bias", value, *LOGIT_BIAS_RANGE)
        out[token_id] = float(value)
    return tuple(sorted(out.items()))


def _integer(name: str, value, low: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSamplingParam(name, f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise InvalidSamplingParam(name, f"{name} must be >= {low}, got {value}")


def _number(name: str, value, low: float, high: float, low_open: bool = False) -> None:
    """A real number in [low, high] ((low, high] with low_open); NaN and infinities fail."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidSamplingParam(name, f"{name} must be a number, got {value!r}")
    inside = (low < value if low_open else low <= value) and value <= high
    if not inside:
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise InvalidSamplingParam(name, f"{name} must be in {bounds}, got {value!r}")


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
    """Mask with -inf everything top-k, top-p and min-p drop. logits (V,) float32."""
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


@dataclass
class TokenLogprob:
    """The sampled token's log-probability and the `k` most likely tokens' (id, logprob)."""
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class SamplerState:
    """One sequence's sampling state: the number of prompt tokens (the penalties count the
    output only), its grammar matcher, kept in step with the sequence's tokens, and the
    logprobs recorded for each sampled token until the engine reports them."""

    def __init__(self, num_prompt_tokens: int, matcher=None):
        self.num_prompt_tokens = num_prompt_tokens
        self.matcher = matcher
        self.num_consumed = 0           # output tokens the matcher has consumed
        self.logprobs: list[TokenLogprob] = []

    def output(self, recent) -> list[int]:
        return list(recent[self.num_prompt_tokens:])

    def sync(self, recent) -> None:
        """Feed the matcher the output tokens it has not seen (sampled since the last call)."""
        if self.matcher is None:
            return
        new = self.output(recent)[self.num_consumed:]
        for token_id in new:
            self.matcher.consume(token_id)
        self.num_consumed += len(new)

    def take_logprob(self) -> TokenLogprob | None:
        return self.logprobs.pop(0) if self.logprobs else None


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
    """One token id from next-token logits (V,) float32. `recent`: the sequence's tokens so far
    (prompt and output), for the penalties and the grammar."""
    state = p.state
    logits = _penalized(logits, p, recent)
    if state is not None and state.matcher is not None:
        state.sync(recent)
        logits = state.matcher.mask(logits)
    if p.greedy:
        token_id = int(logits.argmax())
    else:
        token_id = int(torch.multinomial(_filtered_probs(logits, p), 1, generator=generator))
    if state is not None and p.logprobs is not None:
        state.logprobs.append(token_logprob(logits, token_id, p.logprobs))
    return token_id


def token_logprob(logits: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    """The sampled token's logprob and the top k, from processed logits (V,): ties ranked by id."""
    logprobs = torch.log_softmax(logits.double(), -1).float()
    top = []
    if k:
        values, ids = torch.topk(logprobs, min(k, logprobs.shape[0]))
        top = [(int(i), float(v)) for v, i in zip(values.tolist(), ids.tolist())]
    return TokenLogprob(token_id, float(logprobs[token_id]), top)


def _penalized(logits: torch.Tensor, p: SamplingParams, recent) -> torch.Tensor:
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
    return (filter_logits(logits, p) / max(p.temperature, MIN_TEMPERATURE)).softmax(-1)
