"""Synthetic workloads for `localrun bench`: who asks what, and when.

Prompts are built from a fixed list of common English words, so a prompt of N words is
about N tokens for the BPE tokenizers of current models (each word with its leading space is
one token). A shared prefix becomes the system message (chat) or the start of the prompt
(completions); requests pick one of `num_prefixes` prefixes round-robin. Arrivals are all at
once (rate = inf) or a Poisson process. Everything is derived from `seed`.
"""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which "
         "but have an they you were her she there can all their has been one we would will more if no "
         "when what so out up about into than them only could new some time these two may first then do "
         "any like my now over such our man me even most made after also did many before must through "
         "back years where much your way well down should because each just those people how too "
         "little state good very make world still own see men work long get here between both life being "
         "under never day same another know while last might us great old year off come since against go "
         "came right used take three").split()


@dataclass(frozen=True)
class Scenario:
    num_requests: int = 32
    prompt_tokens: int = 128          # each request's own part, in words (~tokens)
    output_tokens: int = 64
    shared_prefix_tokens: int = 0     # words shared by the requests of one prefix
    num_prefixes: int = 1
    concurrency: int = 0              # most requests in flight at once; 0 = no limit
    request_rate: float = math.inf    # requests per second (Poisson); inf = all at once
    seed: int = 0
    chat: bool = True
    temperature: float = 0.0

    def __post_init__(self):
        checks = [(self.num_requests >= 1, "num_requests must be at least 1"),
                  (self.prompt_tokens >= 1, "prompt_tokens must be at least 1"),
                  (self.output_tokens >= 1, "output_tokens must be at least 1"),
                  (self.shared_prefix_tokens >= 0, "shared_prefix_tokens must be >= 0"),
                  (self.num_prefixes >= 1, "num_prefixes must be at least 1"),
                  (self.concurrency >= 0, "concurrency must be >= 0"),
                  (self.request_rate > 0, "request_rate must be > 0")]
        for ok, message in checks:
            if not ok:
                from localrun.errors import UserError
                raise UserError(message)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["request_rate"] = None if math.isinf(self.request_rate) else self.request_rate
        return d


@dataclass(frozen=True)
class BenchRequest:
    index: int
    arrival_s: float                  # offset from the start of the run
    max_tokens: int
    prompt: str | None = None         # completions
    messages: tuple[dict, ...] | None = None   # chat
    temperature: float = 0.0


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def build_requests(s: Scenario) -> list[BenchRequest]:
    rng = random.Random(s.seed)
    prefixes = [words(rng, s.shared_prefix_tokens) for _ in range(s.num_prefixes)] if s.shared_prefix_tokens else [""]
    t, out = 0.0, []
    for i in range(s.num_requests):
        if not math.isinf(s.request_rate) and i > 0:
            t += rng.expovariate(s.request_rate)
        prefix, own = prefixes[i % len(prefixes)], f"Request {i}: " + words(rng, s.prompt_tokens)
        if s.chat:
            messages = ({"role": "system", "content": prefix},) if prefix else ()
            out.append(BenchRequest(i, t, s.output_tokens, messages=messages + ({"role": "user", "content": own},),
                                    temperature=s.temperature))
        else:
            out.append(BenchRequest(i, t, s.output_tokens, prompt=(prefix + "\n\n" if prefix else "") + own,
                                    temperature=s.temperature))
    return out
