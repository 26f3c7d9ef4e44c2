"""One scheduler Batch -> one Transformer forward -> one sampled token per sampling entry.

The batch's tokens go through the model as one flat sequence of T tokens: the matmuls see
all of them at once, attention runs per entry (a `Segment`) on that sequence's paged view.
Only the rows named by `batch.sample_indices()` are projected to logits. Each sequence
samples with its own SamplingParams and its own seeded generator, which lives here from the
sequence's first sample until `release`, so that a preempted and recomputed sequence draws
the same random numbers it would have drawn alone.
"""
from __future__ import annotations

import torch

from localrun.engine.paged_kv import PagedKVCache
from localrun.engine.scheduler import Batch
from localrun.engine.sequence import Sequence
from localrun.model.llama import Segment, Transformer
from localrun.sampling import SamplingParams, make_generator, sample

DEFAULT_PARAMS = SamplingParams()


class ModelRunner:

    def __init__(self, model: Transformer, kv_cache: PagedKVCache):
        self.model = model
        self.kv_cache = kv_cache
        self.input_device = model.tok_embeddings.device
        self.generators: dict[str, torch.Generator] = {}   # request_id -> its sampler's RNG

    def segments(self, batch: Batch) -> list[Segment]:
        """One Segment per entry: its rows of the flat batch and its view of the KV pool."""
        starts = batch.query_start_locs()
        return [Segment(start=starts[i], length=e.num_new_tokens, cache_start=e.start_position,
                        cache=self.kv_cache.sequence_view(e.seq.block_table))
                for i, e in enumerate(batch.entries)]

    def forward(self, batch: Batch) -> torch.Tensor:
        """float32 logits (len(batch.sample_indices()), V) of the batch's sampling rows."""
        assert not batch.is_empty
        device = self.input_device
        tokens = torch.tensor(batch.input_token_ids(), dtype=torch.long, device=device)    # (T,)
        positions = torch.tensor(batch.positions(), dtype=torch.long, device=device)       # (T,)
        rows = torch.tensor(batch.sample_indices(), dtype=torch.long, device=device)       # (S,)
        return self.model(tokens, positions, self.segments(batch), rows)

    def sample(self, batch: Batch, logits: torch.Tensor) -> list[int]:
        """One token per sampling entry, in entry order (what Scheduler.postprocess takes)."""
        sampling = [e.seq for e in batch.entries if e.samples_token]
        assert logits.shape[0] == len(sampling)
        logits = logits.cpu()
        return [self._sample_one(seq, logits[i]) for i, seq in enumerate(sampling)]

    def _sample_one(self, seq: Sequence, logits: torch.Tensor) -> int:
        params = seq.sampling_params or DEFAULT_PARAMS
        generator = self.generators.get(seq.request_id)
        if generator is None:
            generator = self.generators[seq.request_id] = make_generator(params.seed)
        return sample(logits, params, generator, seq.token_ids)    # penalty over prompt + output

    def execute(self, batch: Batch) -> list[int]:
        return self.sample(batch, self.forward(batch))

    def release(self, seq: Sequence) -> None:
        """Forget a finished sequence's generator."""
        self.generators.pop(seq.request_id, None)
