"""The reference path: one sequence at a time on a contiguous KV cache.

`LLM.logits` runs here (it needs every position's logits), and the tests use `generate` as
the plain reference that the paged, continuously batched engine (localrun/engine/) must
match token for token. The cache remembers the tokens it holds; a prompt that starts with
them computes only the rest."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from localrun.model.kv_cache import ContiguousKVCache
from localrun.model.llama import Segment, Transformer
from localrun.sampling import SamplingParams, make_generator, sample


@dataclass
class SequenceRunner:
    model: Transformer
    n_ctx: int
    cache: ContiguousKVCache = field(init=False)
    cached_ids: list[int] = field(default_factory=list)   # tokens whose KV the cache holds

    def __post_init__(self):
        c = self.model.config
        self.cache = ContiguousKVCache(n_layers=c.n_layers, n_head_kv=c.n_head_kv, head_dim=c.head_dim,
                                       max_tokens=self.n_ctx, dtype=self.model.dtype,
                                       devices=[layer.device for layer in self.model.layers])

    def forward(self, ids: list[int], start: int, all_logits: bool = False) -> torch.Tensor:
        """Run ids at positions start.. on the cache; logits of the last (or every) position."""
        T = len(ids)
        device = self.model.tok_embeddings.device
        tokens = torch.tensor(ids, dtype=torch.long, device=device)
        positions = torch.arange(start, start + T, device=device)
        rows = None if all_logits else torch.tensor([T - 1])
        logits = self.model(tokens, positions, [Segment(0, T, start, self.cache)], rows)
        self.cached_ids = self.cached_ids[:start] + list(ids)
        return logits

    def reusable_prefix(self, ids: list[int]) -> int:
        """How many leading tokens of ids have KV in the cache; the last token is always computed."""
        n = 0
        for a, b in zip(self.cached_ids, ids[:-1]):
            if a != b:
                break
            n += 1
        return n

    def prefill(self, ids: list[int], chunk: int = 512) -> torch.Tensor:
        """Compute the prompt (reusing the cached prefix) -> the last position's logits."""
        start = self.reusable_prefix(ids)
        self.cached_ids = self.cached_ids[:start]
        logits = None
        for i in range(start, len(ids), chunk):
            logits = self.forward(ids[i:i + chunk], i)
        return logits[-1]

    def generate(self, ids: list[int], params: SamplingParams, stop_ids: frozenset[int]) -> Iterator[int]:
        """Yield sampled token ids until max_tokens, a stop token, or the context end.
        The caller may stop iterating early (stop string, Ctrl-C); the cache stays consistent."""
        generator = make_generator(params.seed)
        logits = self.prefill(ids)
        history = list(ids)
        for i in range(params.max_tokens):
            token = sample(logits, params, generator, history)
            history.append(token)
            yield token
            last = i == params.max_tokens - 1
            if last or token in stop_ids and not params.ignore_eos or len(history) >= self.n_ctx:
                return
            logits = self.forward([token], len(history) - 1)[-1]
