"""Paged KV storage: every sequence's keys and values in one pool of fixed-size blocks per layer.

Layer l holds K and V as (num_blocks * block_size, n_kv, hd) tensors on that layer's device,
allocated once. Slot s = block_id * block_size + offset holds one token's K/V for every KV
head. A sequence reaches its tokens through its block table: the token at position p lives in
slot `block_table[p // block_size] * block_size + p % block_size` (the BlockManager's rule).

`PagedSequenceView` gives one sequence the `update(layer, start, k, v) -> (k_all, v_all)`
contract of `ContiguousKVCache`: write the new tokens at their slots, then gather positions
0..start+t-1 back as (n_kv, L, hd). The gather is the plain reference path; a paged-attention
kernel that reads through the block table can replace `gather` without touching the layout.

KV types (`kv_type`): "f32", "bf16", "f16" store the values as they are; "int8" and "fp8"
(float8_e4m3fn) quantize each token's head vector with its own float32 scale on write
(absmax / 127 or / 448) and dequantize into the compute dtype on read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from localrun.errors import UserError

FLOAT_KV_TYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
QUANTIZED_KV_TYPES = ("int8", "fp8")
KV_TYPES = (*FLOAT_KV_TYPES, *QUANTIZED_KV_TYPES)
SCALE_BYTES = 4                      # one float32 scale per token per KV head
INT8_MAX = 127.0


def default_kv_type(compute_dtype: torch.dtype) -> str:
    """The KV type that stores exactly what the model computes."""
    for name, dtype in FLOAT_KV_TYPES.items():
        if dtype == compute_dtype:
            return name
    raise UserError(f"No KV type matches the compute dtype {compute_dtype}; pass kv_type explicitly.")


def fp8_dtype() -> torch.dtype | None:
    """torch.float8_e4m3fn where this torch has it and can cast to and from it, else None."""
    dtype = getattr(torch, "float8_e4m3fn", None)
    if dtype is None:
        return None
    try:
        torch.ones(2).to(dtype).to(torch.float32)
    except (RuntimeError, TypeError):
        return None
    return dtype


def check_kv_type(kv_type: str) -> str:
    if kv_type not in KV_TYPES:
        raise UserError(f"Unknown kv_type {kv_type!r}; choose one of {', '.join(KV_TYPES)}.")
    if kv_type == "fp8" and fp8_dtype() is None:
        raise UserError(f"kv_type 'fp8' needs torch.float8_e4m3fn, which torch {torch.__version__} "
                        f"does not support here; use 'int8' instead.")
    return kv_type


def kv_bytes_per_element(kv_type: str, head_dim: int) -> float:
    """Bytes one K or V element costs in the pool, its share of the scale included."""
    if kv_type in FLOAT_KV_TYPES:
        return FLOAT_KV_TYPES[kv_type].itemsize
    return 1 + SCALE_BYTES / head_dim


@dataclass
class LayerKV:
    """One layer's pool. k, v: (num_slots, n_kv, hd); k_scale, v_scale: (num_slots, n_kv, 1)
    float32 for the quantized types, else None."""
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


class PagedKVCache:

    def __init__(self, *, num_blocks: int, block_size: int, n_layers: int, n_head_kv: int,
                 head_dim: int, kv_type: str, compute_dtype: torch.dtype,
                 devices: list[torch.device] | None = None):
        self.kv_type = check_kv_type(kv_type)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_slots = num_blocks * block_size
        self.n_head_kv, self.head_dim = n_head_kv, head_dim
        self.compute_dtype = compute_dtype
        self.devices = list(devices) if devices is not None else [torch.device("cpu")] * n_layers
        assert len(self.devices) == n_layers
        # storage dtype: fp8 lives as raw bytes (uint8) so that indexing works on every backend
        self.storage_dtype = {"int8": torch.int8, "fp8": torch.uint8}.get(kv_type) or FLOAT_KV_TYPES[kv_type]
        self.layers = [self._allocate(device) for device in self.devices]

    def _allocate(self, device: torch.device) -> LayerKV:
        # torch.empty: pages are committed when first written, so unused blocks cost no RAM;
        # a slot is only ever read after the token at its position was written there
        shape = (self.num_slots, self.n_head_kv, self.head_dim)          # (S, n_kv, hd)
        k = torch.empty(shape, dtype=self.storage_dtype, device=device)
        v = torch.empty(shape, dtype=self.storage_dtype, device=device)
        if self.kv_type in FLOAT_KV_TYPES:
            return LayerKV(k, v)
        scale_shape = (self.num_slots, self.n_head_kv, 1)                # (S, n_kv, 1)
        return LayerKV(k, v, torch.empty(scale_shape, dtype=torch.float32, device=device),
                       torch.empty(scale_shape, dtype=torch.float32, device=device))

    @property
    def num_bytes(self) -> int:
        """Bytes the pool occupies once every slot is written, scales included."""
        total = 0
        for layer in self.layers:
            for t in (layer.k, layer.v, layer.k_scale, layer.v_scale):
                total += 0 if t is None else t.numel() * t.element_size()
        return total

    # --- quantize on write, dequantize on read ------------------------------------------------
    def _encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (t, n_kv, hd) in the compute dtype -> (stored values, scale (t, n_kv, 1) or None)."""
        if self.kv_type in FLOAT_KV_TYPES:
            return x.to(self.storage_dtype), None
        x = x.float()
        qmax = INT8_MAX if self.kv_type == "int8" else torch.finfo(fp8_dtype()).max
        scale = (x.abs().amax(dim=-1, keepdim=True) / qmax).clamp_min(1e-12)   # (t, n_kv, 1)
        scaled = x / scale
        if self.kv_type == "int8":
            return scaled.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale
        return scaled.to(fp8_dtype()).view(torch.uint8), scale

    def _decode(self, stored: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """Inverse of _encode, into the compute dtype; stored (L, n_kv, hd)."""
        if scale is None:
            return stored.to(self.compute_dtype)
        values = stored.view(fp8_dtype()) if self.kv_type == "fp8" else stored
        return (values.float() * scale).to(self.compute_dtype)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (t, n_kv, hd) at slots (t,) of layer."""
        pool = self.layers[layer]
        k_stored, k_scale = self._encode(k)
        v_stored, v_scale = self._encode(v)
        pool.k[slots] = k_stored
        pool.v[slots] = v_stored
        if k_scale is not None:
            pool.k_scale[slots] = k_scale
            pool.v_scale[slots] = v_scale

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference read path: K, V at slots (L,) as (n_kv, L, hd) in the compute dtype."""
        pool = self.layers[layer]
        k = pool.k.index_select(0, slots)                                   # (L, n_kv, hd)
        v = pool.v.index_select(0, slots)
        k_scale = None if pool.k_scale is None else pool.k_scale.index_select(0, slots)
        v_scale = None if pool.v_scale is None else pool.v_scale.index_select(0, slots)
        k, v = self._decode(k, k_scale), self._decode(v, v_scale)
        return k.transpose(0, 1), v.transpose(0, 1)                         # (n_kv, L, hd)

    def sequence_view(self, block_table: list[int], num_tokens: int) -> PagedSequenceView:
        """A view of one sequence's first num_tokens positions through its block table."""
        assert num_tokens <= len(block_table) * self.block_size, "slots not allocated"
        bs = self.block_size
        table = torch.tensor(block_table, dtype=torch.long)
        positions = torch.arange(num_tokens)
        slots = table[positions // bs] * bs + positions % bs                # (num_tokens,)
        return PagedSequenceView(self, slots)


class PagedSequenceView:
    """One sequence's window on the pool with ContiguousKVCache's `update` contract."""

    def __init__(self, cache: PagedKVCache, slots: torch.Tensor):
        self.cache = cache
        self.slots = slots                         # (num_tokens,) slot of each position, on CPU
        self._slots_on: dict[torch.device, torch.Tensor] = {}

    def _slots(self, layer: int) -> torch.Tensor:
        device = self.cache.devices[layer]
        if device not in self._slots_on:
            self._slots_on[device] = self.slots.to(device)
        return self._slots_on[device]

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (t, n_kv, hd) at positions start..start+t-1 and return this layer's keys
        and values for positions 0..start+t-1 as (n_kv, start+t, hd)."""
        end = start + k.shape[0]
        assert end <= self.slots.shape[0], "positions past the view's allocated slots"
        slots = self._slots(layer)
        self.cache.write(layer, slots[start:end], k, v)
        return self.cache.gather(layer, slots[:end])
