"""What a request asks of the sampler (`SamplingParams`), each field checked against its range
once, when the params are made (`InvalidSamplingParam` names the field), and what a sampled
token's logprobs record (`TokenLogprob`). Torch-free: the front end, the server and the
engine core take these; the sampler itself is localrun/sampling.py."""
from __future__ import annotations

from dataclasses import dataclass, field

from localrun.errors import OptionError


class InvalidSamplingParam(OptionError, ValueError):
    """A sampling field out of its range; `field` names it (the server's 400 carries it)."""

    @property
    def field(self) -> str:
        return self.option


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
    min_tokens: int = 0             # vLLM's and llama-cpp-python's: end-of-generation tokens are banned until
                                    # this many are generated, with ignore_eos too (stop strings still stop)
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
        _integer("min_tokens", self.min_tokens, low=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidSamplingParam("min_tokens", f"min_tokens ({self.min_tokens}) must be at most max_tokens "
                                                     f"({self.max_tokens})")
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
                or self.constraint is not None or self.min_tokens > 0)

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


@dataclass
class TokenLogprob:
    """The sampled token's log-probability and the `k` most likely tokens' (id, logprob)."""
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
