"""One scheduler Batch -> one Transformer forward -> one sampled token per sampling entry.

The batch's tokens go through the model as one flat sequence of T tokens: the matmuls see
all of them at once, attention runs per entry (a `Segment`) on that sequence's paged view.
Only the rows named by `batch.sample_indices()` are projected to logits: one per sampling
entry, or 1 + k for an entry that verifies k drafts (speculative decoding), which keeps the
accepted drafts and one more token through `verify_draft`. Each sequence
samples with its own SamplingParams and its own seeded generator, which lives here from the
sequence's first sample until `release`, so that a preempted and recomputed sequence draws
the same random numbers it would have drawn alone.
"""
from __future__ import annotations

from typing import Callable

import torch

from localrun.engine.block_manager import slot_mapping
from localrun.engine.paged_kv import PagedKVCache
from localrun.engine.scheduler import Batch
from localrun.engine.sequence import Sequence
from localrun.engine.speculative import verify_draft
from localrun.model.llama import PagedRows, Segment, SharedPrefix, Transformer
from localrun.sampling import SamplingParams, make_generator, plain_greedy, sample

DEFAULT_PARAMS = SamplingParams()
# A prompt chunk of at most this many rows right after the decode rows (the small chunks an
# inter-token latency target leaves room for, a prompt's tail) is attended by the paged kernel
# too, each row a query over its own prefix, as verify rows are, instead of its cached prefix
# being gathered per layer for one masked SDPA: faster up to 16 rows, slower at 32, where
# SDPA's blocked products win (the kernel reads the keys once per row; docs/measurements.md).
# Only where prompt rows attend through torch's SDPA: with a prompt attention kernel (int8
# prompt math, kernels.attention_bf16 / attention_f32) every prompt row takes that kernel, whose
# rows are their own whatever the chunk, so a prompt's logits do not depend on where its chunks
# end (the scheduler's budget, another request's load) or on how much of it was cached. Routed
# here, a prompt's tail after a prefix hit rounded otherwise than the same rows prefilled
# fresh: SmolLM2's greedy reply to "What is the capital of France?" was "L'Étoile, ..." fresh
# (as llama.cpp's) and "The capital of France is Paris." when its first 32 tokens were cached.
PAGED_PROMPT_ROWS = 16


def num_decode_rows(batch: Batch) -> int:
    """Rows of the leading decode and verify entries (the scheduler puts them before prompt
    chunks): quantized weights compute these the same way whatever the batch."""
    n = 0
    for entry in batch.entries:
        if entry.is_prefill:
            break
        n += entry.num_new_tokens
    return n


def num_paged_entries(batch: Batch, prompt_rows: int = PAGED_PROMPT_ROWS) -> int:
    """The leading entries the paged kernel attends: the decode and verify entries, then the
    prompt chunks of at most prompt_rows rows that follow them."""
    n = 0
    for entry in batch.entries:
        if entry.is_prefill and entry.num_new_tokens > prompt_rows:
            break
        n += 1
    return n


def shared_prefixes(entries, block_size: int, min_blocks: int = 1) -> dict[int, SharedPrefix]:
    """Entry index -> the SharedPrefix it takes part in: prompt chunks of the batch whose block
    tables start with the same blocks, wholly before each chunk's new tokens (cached: a prefix
    hit they all took), at least min_blocks of them, two chunks or more. Those positions are
    attended once for all the chunks' rows (cascade attention, Attention._attend_shared).
    Decode and verify rows never share: their rounding must not depend on the batch."""
    by_first: dict[int, list[int]] = {}
    for i, e in enumerate(entries):
        if e.is_prefill and not e.num_draft_tokens and e.start_position >= block_size * min_blocks:
            by_first.setdefault(e.seq.block_table[0], []).append(i)
    shared: dict[int, SharedPrefix] = {}
    for members in by_first.values():
        if len(members) < 2:
            continue
        tables = [entries[i].seq.block_table for i in members]
        n = min(entries[i].start_position for i in members) // block_size
        n = next((j for j in range(n) if any(t[j] != tables[0][j] for t in tables)), n)
        if n >= min_blocks:
            prefix = SharedPrefix(n * block_size)
            shared.update((i, prefix) for i in members)
    return shared


class ModelRunner:
    """verify_as_decodes: attend each row of a verify entry on its own (a `rowwise` segment),
    so its attention is computed exactly as a plain decode step computes it (one query over
    its prefix); the entry's K/V are still written and read once. Attending all k+1 rows at
    once under a mask rounds differently (about 1e-5 in float32), and the bfloat16
    activations of the quantized kernels can grow that into a different argmax at a near-tie:
    greedy output would then differ from plain decoding.
    Decode and verify rows go through the quantized weights the same way in any batch (the
    model's `decode_rows`: the integer kernel computes every row on its own), so a sequence's
    output does not depend on how many rows share its steps, speculating or not."""

    def __init__(self, model: Transformer, kv_cache: PagedKVCache, verify_as_decodes: bool = True,
                 local_block_tables: Callable[[Sequence], list[int]] | None = None):
        """local_block_tables: a sequence's table in the local layers' pool, where the pool has
        one (BlockManager.local_block_table)."""
        self.model = model
        self.kv_cache = kv_cache
        self.local_block_tables = local_block_tables
        self.verify_as_decodes = verify_as_decodes
        # prompt chunks through the paged kernel only where prompt rows have no kernel of their own
        self.paged_prompt_rows = 0 if any(getattr(layer.attention, "prompt_kernel", None) for layer in model.layers) \
            else PAGED_PROMPT_ROWS
        self.input_device = model.tok_embeddings.device
        self.generators: dict[str, torch.Generator] = {}   # request_id -> its sampler's RNG

    def segments(self, batch: Batch, first_entry: int = 0) -> list[Segment]:
        """One Segment per entry from entry first_entry on (the ones before it are attended by
        the paged kernel): its rows of the flat batch and its view of the KV pool; prompt chunks
        that hold the same cached blocks share them (`shared_prefixes`)."""
        starts, segments = batch.query_start_locs(), []
        shared = shared_prefixes(batch.entries[first_entry:], self.kv_cache.block_size)
        for i, e in enumerate(batch.entries):
            if i < first_entry:
                continue
            local = self.local_block_tables(e.seq) if self.local_block_tables else None
            view = self.kv_cache.sequence_view(e.seq.block_table, local)
            rowwise = bool(e.num_draft_tokens) and self.verify_as_decodes
            segments.append(Segment(starts[i], e.num_new_tokens, e.start_position, view, rowwise,
                                    shared=shared.get(i - first_entry), prompt=e.is_prefill))
        return segments

    def forward(self, batch: Batch) -> torch.Tensor:
        """float32 logits (len(batch.sample_indices()), V) of the batch's sampling rows."""
        assert not batch.is_empty
        device = self.input_device
        tokens = torch.tensor(batch.input_token_ids(), dtype=torch.long, device=device)    # (T,)
        positions = torch.tensor(batch.positions(), dtype=torch.long, device=device)       # (T,)
        rows = torch.tensor(batch.sample_indices(), dtype=torch.long, device=device)       # (S,)
        num_paged = num_paged_entries(batch, self.paged_prompt_rows)
        paged = self.paged_rows(batch, num_paged)
        segments = self.segments(batch, first_entry=num_paged if paged is not None else 0)
        return self.model(tokens, positions, segments, rows, decode_rows=num_decode_rows(batch), paged=paged)

    def paged_rows(self, batch: Batch, num_entries: int) -> PagedRows | None:
        """The metadata of the leading num_entries entries' rows (`num_paged_entries`: decode and
        verify rows, then short prompt chunks) for the paged attention kernel, where the model runs
        localrun's kernels on the CPU over a pool the kernel reads (any KV type); else None."""
        entries = batch.entries[:num_entries]
        if not entries or not self.model.fused or not self.kv_cache.supports_paged_attention:
            return None
        bs = self.kv_cache.block_size
        width = max(len(e.seq.block_table) for e in entries)
        tables = torch.tensor([e.seq.block_table + [0] * (width - len(e.seq.block_table)) for e in entries],
                              dtype=torch.long)                                   # (S, width), padded
        slots = [s for e in entries for s in slot_mapping(e.seq.block_table, bs, e.start_position, e.num_new_tokens)]
        row_seq = [i for i, e in enumerate(entries) for _ in range(e.num_new_tokens)]
        row_len = [p + 1 for e in entries for p in range(e.start_position, e.end_position)]
        num_rows = len(row_seq)
        local_slots = local_tables = None
        if self.local_block_tables is not None:     # the same rows' slots in the local layers' pool
            local = [self.local_block_tables(e.seq) for e in entries]
            local_width = max(len(t) for t in local)
            local_tables = torch.tensor([t + [-1] * (local_width - len(t)) for t in local], dtype=torch.long)
            local_slots = torch.tensor([s for t, e in zip(local, entries)
                                        for s in slot_mapping(t, bs, e.start_position, e.num_new_tokens)])
        scales = self.kv_cache.scales if self.kv_cache.quantized else None   # int8/fp8: the kernel writes them too
        return PagedRows(num_rows, torch.tensor(slots), tables, torch.tensor(row_seq), torch.tensor(row_len), bs,
                         self.kv_cache.float_pools, local_slots, local_tables, scales)

    def sample(self, batch: Batch, logits: torch.Tensor) -> list[int | list[int] | Exception]:
        """Per sampling entry, in entry order (what Scheduler.postprocess takes): one token id,
        or for an entry with drafts the tokens verification keeps. An entry whose sampling
        raises gets the exception in its place: the engine ends that request alone."""
        entries = [e for e in batch.entries if e.samples_token]
        assert logits.shape[0] == sum(e.num_sample_rows for e in entries)
        logits = logits.cpu()
        # plain greedy rows: numpy's argmax (sampling.argmax's), every row's in one call, without
        # the chain's per-row calls (SmolLM2, 16 sequences: 0.43 -> 0.2 ms a step)
        greedy, argmax_ok = None, logits.dtype == torch.float32
        out, row = [], 0
        for entry in entries:
            seq, params = entry.seq, entry.seq.sampling_params or DEFAULT_PARAMS
            try:
                if argmax_ok and not entry.num_draft_tokens and plain_greedy(params):
                    if greedy is None:
                        greedy = logits.numpy().argmax(axis=1).tolist()
                    out.append(greedy[row])
                elif entry.num_draft_tokens:
                    rows = logits[row:row + entry.num_sample_rows]
                    out.append(verify_draft(rows, entry.draft_token_ids, entry.draft_probs, params,
                                            self._generator(seq), seq.token_ids))
                else:   # penalty over prompt + output
                    out.append(sample(logits[row], params, self._generator(seq), seq.token_ids))
            except Exception as e:      # noqa: BLE001 - one request's fault must not end the batch
                out.append(e)
            row += entry.num_sample_rows
        return out

    def _generator(self, seq: Sequence) -> torch.Generator:
        generator = self.generators.get(seq.request_id)
        if generator is None:
            params = seq.sampling_params or DEFAULT_PARAMS
            generator = self.generators[seq.request_id] = make_generator(params.seed)
        return generator

    def execute(self, batch: Batch) -> list[int | list[int]]:
        return self.sample(batch, self.forward(batch))

    def release(self, seq: Sequence) -> None:
        """Forget a finished sequence's generator."""
        self.generators.pop(seq.request_id, None)
