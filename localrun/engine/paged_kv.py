"""Paged KV storage: every sequence's keys and values in one pool of fixed-size blocks per layer.

Layer l holds K and V each as a (num_blocks * block_size, n_kv, hd) tensor on that layer's
device, allocated once. Slot s = block_id * block_size + offset holds one token's vectors for
every KV head. A sequence reaches its tokens through its block table: the token at position p
lives in slot `block_table[p // block_size] * block_size + p % block_size` (the BlockManager's
rule), so reading a sequence is gathering its blocks in table order.

`PagedSequenceView` gives one sequence the `update(layer, start, k, v) -> (k_all, v_all)`
contract of `ContiguousKVCache`: write the new tokens, then gather positions 0..start+t-1 back
as (n_kv, L, hd). That gather is the plain reference path; a paged-attention kernel reading
through the block table can replace `PagedKVCache.gather` without touching the layout. One
fast path exists already: float K/V of a sequence whose blocks are consecutive are returned
as a slice of the pool (no copy), as the contiguous cache does.

KV types (`kv_type`, laid out as layerplan.kv_cache.ENGINE_KV says, which plans size with): "f32",
"bf16", "f16" store values as they are. "fp8" (float8_e4m3fn)
and "int8" quantize on write and dequantize into the compute dtype on read: fp8 K and V, and
int8 V, with one float32 scale per 32 values of a token's head, as llama.cpp's q8_0 blocks
(absmax / 448 or / 127; SmolLM2 int8 top-1 vs f16 KV 99.3%, 99.0% with one scale per head); int8 K with one
scale per block per channel, because keys have outlier channels that a per-token scale
would let swamp the rest (SmolLM2: next-token KL vs f32 KV 8e-4 per token, 2e-4 per channel).
A write into a partly filled block requantizes the block's earlier tokens with the new scale.

The pools are allocated with torch.empty (a page costs RAM only once written), and a slot is
read only after its token was written there. With LOCALRUN_POISON_KV=1 (the test suite sets it)
every pool starts as NaN instead (float values and scales; fp8 codes 0x7F, a NaN), so a read of
an unwritten slot shows as NaN in the output rather than passing or failing on whatever the
memory held.

Whole blocks can be copied out (`copy_blocks`) and written back (`write_block`) exactly as
stored, scales included: that is how the disk tier of the prefix cache saves and restores them.

Sliding-window (local) layers (`local_layers`, `sliding_window`) keep their K/V in a pool of
their own, `num_local_blocks` blocks, addressed through each sequence's local block table
(localrun/engine/window_blocks.py), whose blocks before the window are given back: a local
layer reads only positions from `start - sliding_window + 1` on. The prefix cache's lower tiers
copy the global layers' blocks only.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

from layerplan.kv_cache import ENGINE_KV, ENGINE_SCALE_GROUP, EngineKVType, engine_kv, engine_scale_group
from localrun import kernels
from localrun.errors import UserError

FLOAT_KV_TYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
assert all(ENGINE_KV[name].code_bytes == dtype.itemsize and not ENGINE_KV[name].quantized
           for name, dtype in FLOAT_KV_TYPES.items())
INT8_MAX = 127.0
MIN_SCALE = 1e-12               # an all-zero vector still gets a usable scale
# the layouts are written down once, in layerplan (which plans with them)
SCALE_GROUP = ENGINE_SCALE_GROUP                # values per scale along head_dim for per-token scales
scale_group = engine_scale_group


def fp8_dtype() -> torch.dtype | None:
    """torch.float8_e4m3fn where this torch has it and casts to and from it, else None."""
    dtype = getattr(torch, "float8_e4m3fn", None)
    if dtype is None:
        return None
    try:
        torch.ones(2).to(dtype).to(torch.float32)
    except (RuntimeError, TypeError):
        return None
    return dtype


def pool_layout(kv_type: str) -> EngineKVType:
    """The layout of the engine's KV type `kv_type` (one EngineConfig checked), where this torch can
    store it: fp8 needs torch.float8_e4m3fn."""
    layout = engine_kv(kv_type)
    if layout.name == "fp8" and fp8_dtype() is None:
        raise UserError(f"kv_type 'fp8' needs torch.float8_e4m3fn, which torch {torch.__version__} "
                        f"does not support here; use 'int8' instead.")
    return layout


class WriteTarget(NamedTuple):
    """Where t new tokens go: their slots (t,), and the blocks they fall in (nb,) with the
    first token at `offset` of the first block. Computed once per forward, shared by layers."""
    slots: torch.Tensor
    block_ids: torch.Tensor
    offset: int


class AccessPlan(NamedTuple):
    """One forward's access of one sequence on one device: where the new tokens go, the blocks
    holding all its tokens (nb,), and their first slot if those are consecutive (else None)."""
    target: WriteTarget
    blocks: torch.Tensor
    first_slot: int | None


class PoolKeys(NamedTuple):
    """Where a layer's keys and values for positions first .. first + num_tokens - 1 of one
    sequence lie in the pool: the pools (slots, n_kv, hd) and the blocks holding them (the first
    from position `first`, a multiple of the block size), for a kernel that reads them there; a
    quantized pool's codes come with their scales (the stores' layouts: `scales`)."""
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    blocks: torch.Tensor
    block_size: int
    first: int
    num_tokens: int
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


POISON_ENV = "LOCALRUN_POISON_KV"


def _pool(*shape: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialized pool tensor; NaN throughout under LOCALRUN_POISON_KV=1 (the module's notes).
    int8 codes stay as they are: every byte is a code, but their scales are NaN."""
    t = torch.empty(*shape, dtype=dtype, device=device)
    if os.environ.get(POISON_ENV) == "1":
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype == torch.uint8:
            t.fill_(0x7F)            # float8 e4m3fn's NaN
    return t


class PlainStore:
    """One layer's K (or V) as values: data (num_blocks * bs, n_kv, hd)."""

    def __init__(self, num_blocks: int, block_size: int, n_kv: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.block_size = block_size
        # torch.empty: pages are committed when first written, so unused blocks cost no RAM;
        # a slot is only read after the token at its position was written there
        self.data = _pool(num_blocks * block_size, n_kv, head_dim, dtype=dtype, device=device)

    def tensors(self) -> list[torch.Tensor]:
        return [self.data]

    def per_block(self) -> list[torch.Tensor]:
        """tensors(), each viewed as (num_blocks, ...): everything one block stores is row b."""
        return [self.blocks(t) for t in self.tensors()]

    def blocks(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(-1, self.block_size, *t.shape[1:])          # (num_blocks, bs, ...)

    def write(self, target: WriteTarget, x: torch.Tensor) -> None:
        """x (t, n_kv, hd) at target.slots."""
        self.data.index_copy_(0, target.slots, x.to(self.data.dtype))

    def read(self, block_ids: torch.Tensor, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
        """The first num_tokens tokens of block_ids, in order: (num_tokens, n_kv, hd)."""
        if self.data.dtype == torch.float16 and _compiled_kv(self.data):
            return kernels.gather_kv(self.data, None, block_ids, num_tokens, self.block_size).to(dtype)
        return self.blocks(self.data).index_select(0, block_ids).flatten(0, 1)[:num_tokens].to(dtype)

    def read_slots(self, first_slot: int, num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
        """Fast path for a run of consecutive slots: a view, no copy. (num_tokens, n_kv, hd)"""
        return self.data[first_slot:first_slot + num_tokens].to(dtype)


class TokenScaledStore(PlainStore):
    """Quantized values with one float32 scale per group of 32 values of a token's head:
    scale (num_blocks * bs, n_kv, hd / group).
    fp8 values live as raw bytes (uint8) so that indexing works on every backend."""

    def __init__(self, num_blocks, block_size, n_kv, head_dim, kv_type: str, device):
        self.kv_type = kv_type
        self.float8 = fp8_dtype() if kv_type == "fp8" else None
        super().__init__(num_blocks, block_size, n_kv, head_dim,
                         torch.int8 if kv_type == "int8" else torch.uint8, device)
        self.group = scale_group(head_dim)
        self.scale = _pool(num_blocks * block_size, n_kv, head_dim // self.group, dtype=torch.float32,
                           device=device)

    def tensors(self):
        return [self.data, self.scale]

    def write(self, target, x):
        if _compiled_kv(self.data):
            kernels.write_kv(x.float(), self.data, self.scale, target.slots, self.block_size, fp8=self.float8 is not None)
            return
        t, n_kv, hd = x.shape
        x = x.float().view(t, n_kv, hd // self.group, self.group)                # (t, n_kv, G, group)
        qmax = INT8_MAX if self.float8 is None else torch.finfo(self.float8).max
        scale = (x.abs().amax(-1, keepdim=True) / qmax).clamp_min(MIN_SCALE)   # (t, n_kv, G, 1)
        if self.float8 is None:
            q = (x / scale).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        else:
            q = (x / scale).to(self.float8).view(torch.uint8)
        self.data.index_copy_(0, target.slots, q.view(t, n_kv, hd))
        self.scale.index_copy_(0, target.slots, scale[..., 0])

    def read(self, block_ids, num_tokens, dtype):
        if self.float8 is None and _compiled_kv(self.data):
            return kernels.gather_kv(self.data, self.scale, block_ids, num_tokens, self.block_size,
                                     self.group).to(dtype)
        q = self.blocks(self.data).index_select(0, block_ids).flatten(0, 1)[:num_tokens]
        scale = self.blocks(self.scale).index_select(0, block_ids).flatten(0, 1)[:num_tokens]
        values = q if self.float8 is None else q.view(self.float8)
        L, n_kv, hd = values.shape
        grouped = values.float().view(L, n_kv, hd // self.group, self.group)    # (L, n_kv, G, group)
        return grouped.mul_(scale[..., None]).view(L, n_kv, hd).to(dtype)     # in place: mixed-dtype mul is slow


class ChannelScaledStore(PlainStore):
    """int8 values with one float32 scale per block per channel: scale (num_blocks, n_kv, hd)."""

    def __init__(self, num_blocks, block_size, n_kv, head_dim, device):
        super().__init__(num_blocks, block_size, n_kv, head_dim, torch.int8, device)
        self.scale = _pool(num_blocks, n_kv, head_dim, dtype=torch.float32, device=device)

    def tensors(self):
        return [self.data, self.scale]

    def per_block(self):
        return [self.blocks(self.data), self.scale]              # the scale is per block already

    def write(self, target, x):
        # the written blocks belong to this sequence alone (shared blocks are full and never
        # written), so whole blocks are rewritten: earlier tokens of the first block plus x
        if _compiled_kv(self.data):
            kernels.write_kv(x.float(), self.data, self.scale, target.slots, self.block_size, per_block=True)
            return
        bs, t, block_ids, offset = self.block_size, x.shape[0], target.block_ids, target.offset
        blocks = self.blocks(self.data)                                         # (B, bs, n_kv, hd)
        window = x.new_zeros((len(block_ids) * bs, *x.shape[1:]), dtype=torch.float32)
        if offset:
            first = block_ids[0]
            window[:offset] = blocks[first, :offset].float() * self.scale[first]
        window[offset:offset + t] = x.float()
        window = window.view(len(block_ids), bs, *x.shape[1:])                   # (nb, bs, n_kv, hd)
        scale = (window.abs().amax(1) / INT8_MAX).clamp_min(MIN_SCALE)           # (nb, n_kv, hd)
        blocks[block_ids] = (window / scale[:, None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        self.scale[block_ids] = scale

    def read(self, block_ids, num_tokens, dtype):
        if _compiled_kv(self.data):
            return kernels.gather_kv(self.data, self.scale, block_ids, num_tokens, self.block_size,
                                     per_block=True).to(dtype)
        q = self.blocks(self.data).index_select(0, block_ids)                    # (nb, bs, n_kv, hd)
        scale = self.scale.index_select(0, block_ids)[:, None]                  # (nb, 1, n_kv, hd)
        return q.float().mul_(scale).flatten(0, 1)[:num_tokens].to(dtype)


def _compiled_kv(data: torch.Tensor) -> bool:
    """Whether a pool's blocks are read by the compiled gather (kernels.gather_kv: float16 and
    int8, one pass per block) and a quantized pool's rows written by kernels.write_kv: the same
    values as the torch code beside each, which is the reference and the path without the kernels
    or off the CPU."""
    return data.device.type == "cpu" and kernels.available()


class PagedKVCache:

    def __init__(self, *, num_blocks: int, block_size: int, n_layers: int, n_head_kv: int,
                 head_dim: int, kv_type: str, compute_dtype: torch.dtype,
                 devices: list[torch.device] | None = None, slice_fast_path: bool = True,
                 local_layers: tuple[bool, ...] = (), num_local_blocks: int = 0, sliding_window: int | None = None):
        self.layout = layout = pool_layout(kv_type)
        self.kv_type = layout.name
        # a sequence whose blocks are consecutive reads its float K/V as a view (no gather)
        self.slice_fast_path = slice_fast_path and not layout.quantized
        self.num_blocks, self.block_size = num_blocks, block_size
        self.compute_dtype = compute_dtype
        self.devices = list(devices) if devices is not None else [torch.device("cpu")] * n_layers
        assert len(self.devices) == n_layers
        self.local_layers = tuple(local_layers) if num_local_blocks and sliding_window else ()
        self.num_local_blocks, self.sliding_window = num_local_blocks, sliding_window

        def store(scales: str | None, n_blocks: int, device: torch.device) -> PlainStore:
            """One layer's K or V as the layout says: values as they are, or codes with a scale per
            32 values of a token's head ("token") or per block per channel ("block")."""
            shape = (n_blocks, block_size, n_head_kv, head_dim)
            if scales is None:
                return PlainStore(*shape, FLOAT_KV_TYPES[layout.name], device)
            if scales == "block":
                assert layout.name == "int8", layout
                return ChannelScaledStore(*shape, device)
            return TokenScaledStore(*shape, layout.name, device)

        def layer_stores(layer: int, device: torch.device):
            n_blocks = num_local_blocks if self.is_local(layer) else num_blocks
            return store(layout.key_scales, n_blocks, device), store(layout.value_scales, n_blocks, device)

        self.layers = [layer_stores(i, device) for i, device in enumerate(self.devices)]
        self._named_block_tensors: dict[str, torch.Tensor] | None = None

    def is_local(self, layer: int) -> bool:
        """Whether the layer's K/V live in the local (sliding-window) pool."""
        return bool(self.local_layers) and self.local_layers[layer]

    @property
    def supports_paged_attention(self) -> bool:
        """Whether localrun::paged_attention can read and write this pool in place: any KV type
        on the CPU, for a float32 model (it quantizes int8/fp8 rows as the stores do)."""
        return self.compute_dtype == torch.float32 and all(d.type == "cpu" for d in self.devices)

    @property
    def quantized(self) -> bool:
        """Whether values are stored as codes with scales (int8, fp8)."""
        return self.layout.quantized

    def scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A quantized layer's K and V scales, as the paged kernel reads them."""
        k_store, v_store = self.layers[layer]
        return k_store.scale, v_store.scale

    def readable_in_place(self, layer: int) -> bool:
        """Whether a kernel can read the layer's keys and values where they lie (PoolKeys): a
        pool on the CPU, of any KV type (int8 and fp8 codes with their scales)."""
        return self.devices[layer].type == "cpu"

    def pool_keys(self, layer: int, blocks: torch.Tensor, first: int, num_tokens: int) -> PoolKeys:
        """Positions first .. first + num_tokens - 1 of the layer's pool in `blocks` (from the block
        holding `first`), with a quantized pool's scales."""
        scales = self.scales(layer) if self.quantized else (None, None)
        return PoolKeys(*self.float_pools(layer), blocks, self.block_size, first, num_tokens, *scales)

    def float_pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer's K and V values (codes, for a quantized pool), (num_blocks * block_size, n_kv, hd),
        for the paged kernel."""
        k_store, v_store = self.layers[layer]
        return k_store.data, v_store.data

    @property
    def num_bytes(self) -> int:
        """Bytes the pool occupies once every slot is written, scales included."""
        return sum(t.numel() * t.element_size()
                   for k, v in self.layers for t in k.tensors() + v.tensors())

    def named_block_tensors(self) -> dict[str, torch.Tensor]:
        """Every pool tensor as (num_blocks, ...), named "<layer>.k.<i>" / "<layer>.v.<i>"
        (views of the pool, built once: the pool never moves)."""
        if self._named_block_tensors is None:
            self._named_block_tensors = {f"{layer}.{kind}.{i}": t
                                         for layer, (k_store, v_store) in enumerate(self.layers)
                                         if not self.is_local(layer)     # the local pool has its own ids
                                         for kind, store in (("k", k_store), ("v", v_store))
                                         for i, t in enumerate(store.per_block())}
        return self._named_block_tensors

    def copy_blocks(self, block_ids: list[int]) -> list[dict[str, torch.Tensor]]:
        """A host-memory copy of each block's stored K/V (quantized values and scales as they
        are), one dict per block; one gather per pool tensor."""
        index = torch.tensor(block_ids, dtype=torch.long)
        copies = {name: t.index_select(0, index.to(t.device)).cpu()
                  for name, t in self.named_block_tensors().items()}
        return [{name: c[j] for name, c in copies.items()} for j in range(len(block_ids))]

    def write_block(self, block_id: int, tensors: dict[str, torch.Tensor]) -> None:
        """Put back what copy_blocks returned for one block (names, shapes and dtypes must match)."""
        for name, t in self.named_block_tensors().items():
            t[block_id].copy_(tensors[name])

    def block_layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of one block's tensors, to check a stored block before use."""
        return {name: (tuple(t.shape[1:]), t.dtype) for name, t in self.named_block_tensors().items()}

    def write(self, layer: int, target: WriteTarget, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (t, n_kv, hd) at target."""
        k_store, v_store = self.layers[layer]
        k_store.write(target, k)
        v_store.write(target, v)

    def gather(self, layer: int, block_ids: torch.Tensor, num_tokens: int):
        """The reference read path: K, V of the first num_tokens tokens held by block_ids,
        as (n_kv, num_tokens, hd) in the compute dtype."""
        k_store, v_store = self.layers[layer]
        k = k_store.read(block_ids, num_tokens, self.compute_dtype)             # (L, n_kv, hd)
        v = v_store.read(block_ids, num_tokens, self.compute_dtype)
        return k.transpose(0, 1), v.transpose(0, 1)                             # (n_kv, L, hd)

    def read_slots(self, layer: int, first_slot: int, num_tokens: int):
        """gather's fast path where the tokens sit in consecutive slots from first_slot."""
        k_store, v_store = self.layers[layer]
        k = k_store.read_slots(first_slot, num_tokens, self.compute_dtype)     # (L, n_kv, hd)
        v = v_store.read_slots(first_slot, num_tokens, self.compute_dtype)
        return k.transpose(0, 1), v.transpose(0, 1)                             # (n_kv, L, hd)

    def sequence_view(self, block_table: list[int], local_block_table: list[int] | None = None) -> PagedSequenceView:
        local = torch.tensor(local_block_table, dtype=torch.long) if local_block_table is not None else None
        assert local is not None or not self.local_layers, "a pool with local layers needs the local block table"
        return PagedSequenceView(self, torch.tensor(block_table, dtype=torch.long), local)


class PagedSequenceView:
    """One sequence's window on the pool, with ContiguousKVCache's `update` contract."""

    def __init__(self, cache: PagedKVCache, block_table: torch.Tensor, local_block_table: torch.Tensor | None = None):
        self.cache = cache
        self.block_table = block_table          # (num_blocks,) on the CPU
        self.local_block_table = local_block_table   # (num_blocks,) in the local pool, -1 out of the window
        self._plans: dict[tuple, AccessPlan] = {}

    def first_position(self, layer: int, start: int) -> int:
        """The first position `update` returns for new tokens from `start` on: 0, or in a local
        layer the start of the first block that a query at `start` reaches."""
        if not self.cache.is_local(layer):
            return 0
        bs = self.cache.block_size
        return max(0, start - self.cache.sliding_window + 1) // bs * bs

    def _first_slot(self, blocks: torch.Tensor) -> int | None:
        """The first slot of `blocks` where they are consecutive (one slice of the pool reads
        them) and the cache takes that fast path; else None (gathered block by block)."""
        first_block = int(blocks[0])
        consecutive = torch.equal(blocks, torch.arange(first_block, first_block + len(blocks)))
        return first_block * self.cache.block_size if self.cache.slice_fast_path and consecutive else None

    def plan(self, layer: int, start: int, end: int, first: int = 0) -> AccessPlan:
        """How positions start..end-1 are written and first..end-1 read on the layer's device (in a
        local layer, from the first block the window reaches; `first` is a multiple of the block
        size). Computed by the first layer of a forward, reused by the others."""
        device = self.cache.devices[layer]
        local = self.cache.is_local(layer)
        key = (device, start, end, local, first)
        if key not in self._plans:
            bs = self.cache.block_size
            table = self.local_block_table if local else self.block_table
            assert end <= len(table) * bs, "positions past the allocated blocks"
            assert first % bs == 0 and first <= start, "a read from a block's start, before the new tokens"
            positions = torch.arange(start, end)
            slots = table[positions // bs] * bs + positions % bs                    # (t,)
            first = max(first, self.first_position(layer, start)) // bs
            blocks = table[first:-(-end // bs)]                                     # (nb,)
            assert bool((blocks >= 0).all()), "a block the window reaches was freed"
            first_slot = self._first_slot(blocks)
            blocks = blocks.to(device)
            target = WriteTarget(slots.to(device), blocks[start // bs - first:], start % bs)
            self._plans[key] = AccessPlan(target, blocks, first_slot)
        return self._plans[key]

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor, first: int = 0):
        """Write k, v (t, n_kv, hd) at positions start..start+t-1 and return this layer's keys
        and values for positions first..start+t-1 (from first_position(layer, start) on in a local
        layer) as (n_kv, L, hd). first: 0, or a multiple of the block size up to start (the
        positions before it are read once for several sequences, `read`)."""
        end = start + k.shape[0]
        target, blocks, first_slot = self.plan(layer, start, end, first)
        self.cache.write(layer, target, k, v)
        num_tokens = end - max(first, self.first_position(layer, start))   # a local layer reads its window only
        if first_slot is not None:
            return self.cache.read_slots(layer, first_slot, num_tokens)
        return self.cache.gather(layer, blocks, num_tokens)

    def update_in_pool(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor, first: int = 0) -> PoolKeys | None:
        """As `update`, but instead of a copy of the keys and values, where they lie in the pool
        (the prompt attention kernels read them there); None, with nothing written, where the
        pool cannot be read in place (`readable_in_place`)."""
        if not self.cache.readable_in_place(layer):
            return None
        end = start + k.shape[0]
        target, blocks, _ = self.plan(layer, start, end, first)
        self.cache.write(layer, target, k, v)
        begin = max(first, self.first_position(layer, start))
        return self.cache.pool_keys(layer, blocks, begin, end - begin)

    def pool_keys(self, layer: int, end: int) -> PoolKeys:
        """Where positions 0..end-1 (written; `end` a multiple of the block size; not a local
        layer) lie in a pool `readable_in_place`."""
        bs = self.cache.block_size
        assert end % bs == 0 and not self.cache.is_local(layer) and self.cache.readable_in_place(layer)
        return self.cache.pool_keys(layer, self.block_table[:end // bs], 0, end)

    def read(self, layer: int, end: int):
        """This layer's keys and values for positions 0..end-1 (already written; `end` a
        multiple of the block size; not for a local layer) as (n_kv, end, hd)."""
        bs = self.cache.block_size
        assert end % bs == 0 and not self.cache.is_local(layer)
        key = (self.cache.devices[layer], "read", end)
        if key not in self._plans:
            blocks = self.block_table[:end // bs]
            self._plans[key] = AccessPlan(None, blocks.to(self.cache.devices[layer]), self._first_slot(blocks))
        _, blocks, first_slot = self._plans[key]
        if first_slot is not None:
            return self.cache.read_slots(layer, first_slot, end)
        return self.cache.gather(layer, blocks, end)
