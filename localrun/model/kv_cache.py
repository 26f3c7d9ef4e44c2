"""KV storage the attention layers read and write.

`ContiguousKVCache` holds one sequence's keys and values in fixed-shape tensors allocated once
(gpt-fast style), each layer's on that layer's device. The paged cache of the engine-core issue implements the same `update` method,
reading through a block table instead of a contiguous slice.
"""
from __future__ import annotations

import torch


class ContiguousKVCache:
    def __init__(self, *, n_layers: int, n_head_kv: int, head_dim: int, max_tokens: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu",
                 devices: list[torch.device | str] | None = None):
        shape = (n_head_kv, max_tokens, head_dim)              # per layer: (n_kv, max_tokens, hd)
        devices = [torch.device(d) for d in devices or [device] * n_layers]
        if len(set(devices)) == 1:    # one tensor (L, n_kv, max_tokens, hd); k[layer] is a view
            self.k = torch.zeros((n_layers, *shape), dtype=dtype, device=devices[0])
            self.v = torch.zeros((n_layers, *shape), dtype=dtype, device=devices[0])
        else:                         # one tensor per layer, on its device
            self.k = [torch.zeros(shape, dtype=dtype, device=d) for d in devices]
            self.v = [torch.zeros(shape, dtype=dtype, device=d) for d in devices]
        self.max_tokens = max_tokens

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (t, n_kv, hd) at positions start..start+t-1 and return this layer's
        keys and values for positions 0..start+t-1 as (n_kv, start+t, hd) views."""
        end = start + k.shape[0]
        assert end <= self.max_tokens, "KV cache overflow: the caller must check the context size"
        self.k[layer][:, start:end] = k.transpose(0, 1)
        self.v[layer][:, start:end] = v.transpose(0, 1)
        return self.k[layer][:, :end], self.v[layer][:, :end]
