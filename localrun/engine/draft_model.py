"""The draft model of speculative decoding: a smaller model (or the target's own first layers)
that proposes k tokens per step, one batched forward per drafted position.

Its KV cache is its own: one contiguous, growing cache per sequence, plus the token ids whose
K/V it holds. Rolling back rejected drafts is keeping the longest common prefix of those ids
and the sequence's tokens (as SequenceRunner.reusable_prefix does for the plain runner), so the
draft's cache can never disagree with what the target accepted; the next proposal computes
what differs (the accepted correction, or tokens generated while the request was not drafting).
"""
from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from localrun.engine.sequence import Sequence
from localrun.errors import UserError
from localrun.model.llama import Segment, Transformer
from localrun.sampling import SamplingParams, make_generator, probabilities, sample


class DraftKVCache:
    """One sequence's K/V, per layer (n_kv, capacity, hd) on that layer's device, doubled when
    full; the `update` contract of ContiguousKVCache. Used for the draft model's sequences and
    for the scratch forwards that time a model."""

    def __init__(self, n_layers: int, n_head_kv: int, head_dim: int, dtype: torch.dtype, capacity: int = 64,
                 devices: list[torch.device] | None = None):
        devices = devices or [torch.device("cpu")] * n_layers
        self.k = [torch.empty(n_head_kv, capacity, head_dim, dtype=dtype, device=d) for d in devices]
        self.v = [torch.empty_like(k) for k in self.k]

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        end = start + k.shape[0]
        if end > self.k[layer].shape[1]:        # grow: earlier positions are kept
            for store in (self.k, self.v):
                old = store[layer]
                store[layer] = old.new_empty(old.shape[0], max(end, 2 * old.shape[1]), old.shape[2])
                store[layer][:, :old.shape[1]] = old
        self.k[layer][:, start:end] = k.transpose(0, 1)
        self.v[layer][:, start:end] = v.transpose(0, 1)
        return self.k[layer][:, :end], self.v[layer][:, :end]


def layer_devices(model: Transformer) -> list[torch.device]:
    return [layer.attention.wqkv.device for layer in model.layers]


@dataclasses.dataclass
class DraftState:
    cache: DraftKVCache
    generator: torch.Generator
    token_ids: list[int] = dataclasses.field(default_factory=list)   # whose K/V the cache holds


def self_draft(model: Transformer, num_layers: int) -> Transformer:
    """The target's first num_layers blocks plus its final norm and output head, sharing every
    weight with it (no memory): a draft with the target's vocabulary by construction."""
    if not 1 <= num_layers < model.config.n_layers:
        raise UserError(f"A self-draft needs between 1 and {model.config.n_layers - 1} layers, got {num_layers}.")
    draft = copy.copy(model)
    draft._modules = dict(model._modules)       # so that replacing `layers` leaves the target alone
    draft.layers = nn.ModuleList(list(model.layers)[:num_layers])
    draft.config = dataclasses.replace(model.config, n_layers=num_layers)
    return draft


def check_vocab_compatible(target_pieces: list[bytes], draft_pieces: list[bytes], draft_name: str) -> None:
    """A draft must spell every token id as the target does, or its guesses mean other text."""
    if len(target_pieces) != len(draft_pieces):
        raise UserError(f"The draft model {draft_name} has {len(draft_pieces)} tokens but the target has "
                        f"{len(target_pieces)}; a draft model needs the same vocabulary.")
    for i, (a, b) in enumerate(zip(target_pieces, draft_pieces)):
        if a != b:
            raise UserError(f"The draft model {draft_name} has a different vocabulary (token {i} is "
                            f"{b!r} there and {a!r} in the target); a draft model needs the same vocabulary.")


class DraftModelProposer:

    def __init__(self, model: Transformer):
        self.model = model
        self.device = model.tok_embeddings.device
        self.states: dict[str, DraftState] = {}

    def _state(self, seq: Sequence) -> DraftState:
        state = self.states.get(seq.request_id)
        if state is None:
            c = self.model.config
            params = seq.sampling_params
            seed = None if params is None or params.seed is None else params.seed + 1
            state = self.states[seq.request_id] = DraftState(
                DraftKVCache(c.n_layers, c.n_head_kv, c.head_dim, self.model.dtype, devices=layer_devices(self.model)),
                make_generator(seed))
        return state

    def propose(self, wanted: list[tuple[Sequence, int]]) -> list[tuple[list[int], torch.Tensor | None]]:
        """k draft tokens per (sequence, k), and the (k, V) distributions they were drawn from
        (None at temperature 0, where verification only compares argmaxes)."""
        states = [self._state(seq) for seq, _ in wanted]
        drafts: list[list[int]] = [[] for _ in wanted]
        probs: list[list[torch.Tensor]] = [[] for _ in wanted]
        # first forward: each sequence's tokens the draft has not seen (at least its last one);
        # then one forward per drafted position, feeding the previous draft
        pending = {i: seq.token_ids[self._rollback(seq, state):] for i, ((seq, _), state)
                   in enumerate(zip(wanted, states))}
        active = list(range(len(wanted)))
        for step in range(max(k for _, k in wanted)):
            active = [i for i in active if len(drafts[i]) < wanted[i][1]]
            if step > 0:
                pending = {i: [drafts[i][-1]] for i in active}
            logits = self._forward([(states[i], pending[i]) for i in active])
            for row, i in enumerate(active):
                seq, state = wanted[i][0], states[i]
                state.token_ids += pending[i]
                params = seq.sampling_params or SamplingParams()
                history = seq.token_ids + drafts[i]
                if params.greedy:
                    drafts[i].append(sample(logits[row], params, state.generator, history))
                else:
                    q = probabilities(logits[row], params, history)
                    drafts[i].append(int(torch.multinomial(q, 1, generator=state.generator)))
                    probs[i].append(q)
        return [(d, torch.stack(p) if p else None) for d, p in zip(drafts, probs)]

    @staticmethod
    def _rollback(seq: Sequence, state: DraftState) -> int:
        """Keep the draft's K/V of the longest common prefix with seq's tokens, short of seq's
        last token (its logits are needed); returns how many tokens that is."""
        n, limit = 0, min(seq.num_tokens - 1, len(state.token_ids))
        while n < limit and state.token_ids[n] == seq.token_ids[n]:
            n += 1
        del state.token_ids[n:]
        return n

    def _forward(self, work: list[tuple[DraftState, list[int]]]) -> torch.Tensor:
        """One batched draft forward; float32 logits (len(work), V) at each one's last token."""
        tokens, positions, segments, rows = [], [], [], []
        for state, new in work:
            start = len(tokens)
            cache_start = len(state.token_ids)
            tokens += new
            positions += range(cache_start, cache_start + len(new))
            segments.append(Segment(start, len(new), cache_start, state.cache))
            rows.append(start + len(new) - 1)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)   # noqa: E731
        return self.model(as_tensor(tokens), as_tensor(positions), segments, as_tensor(rows)).cpu()

    def release(self, request_id: str) -> None:
        self.states.pop(request_id, None)
