"""Weights kept quantized in memory, multiplied by torch's weight-only int4 / int8 kernels.

A GGUF file stores most llama weights in 32-value blocks with a scale (and a minimum). The
4-bit ones (Q4_0, Q4_1, Q4_K) map onto torch's int4 format, groups of 32 with
w = (q - 8) * scale + zero, exactly up to rounding the scales to bfloat16:

    Q4_0: w = (q - 8) * d              -> scale d,      zero 0
    Q4_1: w = q * d + m                -> scale d,      zero m + 8 d
    Q4_K: w = q * d*sc - dmin*mn       -> scale d*sc,   zero 8 d*sc - dmin*mn   (per 32 of a 256 block)

Q8_0 has one scale per 32 values but torch's int8 kernel one per row, so Q8_0 is requantized
per row (the error is measured by tests/test_quant.py). Every other type is dequantized into
the compute dtype (`PlainWeight`, the reference path).

Each weight kind is a small class with the same face: `weight(x)` is x @ w.T as F.linear,
`.device`, `.nbytes`, `.dequantize()` (the reference, for tests) and `.rows(ids)` where a kind
supports embedding lookups. The kernels take bfloat16 activations; the result comes back in
x's dtype. Both the CPU and the CUDA variants are feature-detected (`int4_backend`).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT
from gguf.quants import Q4_K, dequantize

from localrun.model.gguf_weight import GGUFWeight, WeightMath, kernel_types, rows_tensor

GROUP = 32                                   # values per int4 scale, as the 32-value GGUF blocks
INT4_TYPES = (QT.Q4_0, QT.Q4_1, QT.Q4_K)
INT8_TYPES = (QT.Q8_0,)
KERNEL_DTYPE = torch.bfloat16                # the activations the weight-only kernels take


# --- what the file holds, unpacked (numpy, on the host) ----------------------------------------
@dataclass
class Int4Groups:
    """A 4-bit tensor as codes (N, K) uint8 in 0..15 and per-group scale, zero (N, K/32) float32."""
    codes: np.ndarray
    scale: np.ndarray
    zero: np.ndarray

    def dequantize(self) -> np.ndarray:
        n, k = self.codes.shape
        q = self.codes.reshape(n, k // GROUP, GROUP).astype(np.float32) - 8
        return (q * self.scale[..., None] + self.zero[..., None]).reshape(n, k)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(blocks, 16) packed bytes -> (blocks, 32) codes: the low nibbles are values 0..15, the
    high nibbles values 16..31 (ggml's layout for every 32-value 4-bit block)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def int4_groups(raw: np.ndarray, qtype: QT, shape: tuple[int, int]) -> Int4Groups:
    """GGUF blocks of a Q4_0/Q4_1/Q4_K tensor, raw (rows, bytes per row) -> Int4Groups."""
    n, k = shape
    blocks = np.ascontiguousarray(raw).reshape(-1, raw.size // (n * k // _block_size(qtype)))
    f16 = lambda b: b.view(np.float16).astype(np.float32)      # noqa: E731
    if qtype == QT.Q4_0:                                       # d f16, qs[16]
        d = f16(blocks[:, 0:2])
        codes, scale, zero = _nibbles(blocks[:, 2:]), d, np.zeros_like(d)
    elif qtype == QT.Q4_1:                                     # d f16, m f16, qs[16]
        d, m = f16(blocks[:, 0:2]), f16(blocks[:, 2:4])
        codes, scale, zero = _nibbles(blocks[:, 4:]), d, m + 8 * d
    elif qtype == QT.Q4_K:                                     # d, dmin f16, scales[12], qs[128]
        d, dmin = f16(blocks[:, 0:2]), f16(blocks[:, 2:4])
        sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])           # (blocks, 8) 6-bit each
        scale = d * sc.astype(np.float32)                      # (blocks, 8): one per 32 values
        zero = 8 * scale - dmin * mn.astype(np.float32)
        qs = blocks[:, 16:].reshape(-1, 4, 32)                 # 4 chunks of 64 values: low then high nibbles
        codes = np.stack([qs & 0x0F, qs >> 4], axis=2)         # (blocks, 4, 2, 32)
    else:
        raise ValueError(f"{qtype.name} is not a 4-bit type")
    return Int4Groups(codes.reshape(n, k).astype(np.uint8), scale.reshape(n, k // GROUP).astype(np.float32),
                      zero.reshape(n, k // GROUP).astype(np.float32))


def _block_size(qtype: QT) -> int:
    from gguf import GGML_QUANT_SIZES
    return GGML_QUANT_SIZES[qtype][0]


def int8_rows(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float (N, K) -> int8 codes (N, K) and one scale per row (absmax / 127, rounded up to a
    bfloat16 value so that the kernel's bfloat16 copy of it is exact)."""
    scale = np.abs(weight).max(axis=1) / 127.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    scale = _bf16_ceil(scale)
    codes = np.clip(np.rint(weight / scale[:, None]), -127, 127).astype(np.int8)
    return codes, scale


def _bf16_ceil(x: np.ndarray) -> np.ndarray:
    """The smallest bfloat16 values >= x (positive float32 x)."""
    bits = x.astype(np.float32).view(np.uint32)
    up = (bits + np.uint32(0xFFFF)) & np.uint32(0xFFFF0000)
    return up.view(np.float32)


# --- kernels: feature detection ----------------------------------------------------------------
CPU_PACK_ROWS = 32       # torch's CPU int4 pack: (N/32, K, 16) bytes, low nibble row j, high row j + 16


def unpack_cpu_codes(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """torch's CPU int4 pack (N, K/2) uint8 -> codes (N, K) uint8 (the inverse of
    _convert_weight_to_int4pack_for_cpu, as `cpu_pack_layout_known` checks)."""
    blocks = packed.view(n // CPU_PACK_ROWS, k, CPU_PACK_ROWS // 2)
    codes = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1)                  # (N/32, K, 32)
    return codes.transpose(1, 2).reshape(n, k)


@lru_cache(maxsize=None)
def cpu_pack_layout_known() -> bool:
    """Whether this torch packs int4 for the CPU in the layout `unpack_cpu_codes` reads."""
    try:
        codes = torch.randint(0, 16, (64, 96), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        return tuple(packed.shape) == (64, 48) and torch.equal(unpack_cpu_codes(packed, 64, 96), codes.to(torch.uint8))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


@lru_cache(maxsize=None)
def int4_backend(device_type: str) -> str | None:
    """'cpu' or 'cuda' where torch's int4 weight-only matmul runs on this device type and agrees
    with its own dequantized weights on a tiny probe, else None (their signatures have changed
    between torch releases, so presence alone proves nothing)."""
    try:
        g = Int4Groups(np.arange(64 * 128, dtype=np.uint8).reshape(64, 128) % 16,
                       np.full((64, 4), 0.5, np.float32), np.full((64, 4), 0.25, np.float32))
        w = Int4Weight.from_groups(g, torch.device(device_type))
        x = torch.linspace(-1, 1, 128, device=device_type)[None]
        expected = x @ torch.from_numpy(g.dequantize()).to(device_type).T
        return device_type if torch.allclose(w(x).float(), expected, rtol=2e-2, atol=5e-2) else None
    except (RuntimeError, AttributeError, NotImplementedError, AssertionError):
        return None


@lru_cache(maxsize=None)
def int8_backend(device_type: str) -> bool:
    """Whether torch's int8 weight-only matmul runs on this device type (CPU and MPS have it)."""
    try:
        w = Int8Weight([torch.ones(8, 32, dtype=torch.int8, device=device_type)],
                       [torch.full((8,), 0.5, device=device_type)])
        return torch.allclose(w(torch.ones(1, 32, device=device_type)).float(),
                              torch.full((1, 8), 16.0, device=device_type))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


# --- weights as the model holds them ------------------------------------------------------------
class PlainWeight:
    """The reference path: a dense (N, K) tensor in the compute dtype."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def __call__(self, x: torch.Tensor, decode_rows: int = 0) -> torch.Tensor:
        return F.linear(x, self.weight)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]

    def dequantize(self) -> torch.Tensor:
        return self.weight

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class Int4Weight:
    """int4 codes packed for torch's kernel, with scales and zeros (K/32, N, 2) in bfloat16.

    The kernel wants bfloat16 scales and zeros, which rounds every group's scale and zero by
    up to 2^-9: a systematic error per group that costs SmolLM2 about 1% of its top-1
    predictions. So a second call with the same codes and the rounding residuals as scales
    and zeros, (q - 8) * (s - s_bf16) + (z - z_bf16), adds back what the rounding took
    (`residual`, on by default; the codes are read twice, the second time mostly from cache).

    x goes in as two bfloat16 rows, x_hi + x_lo (about 16 bits), as in Int8Weight: with x in
    bfloat16 alone, float32 noise of 1e-7 (a batch of 5 rows against 1) flips bfloat16 roundings
    into ~1e-3 logit differences, enough to change greedy tokens between speculative and plain
    decoding. In a memory-bound matvec the second row costs little.

    The kernel pays off for a few rows (decode). For a prompt chunk of DEQUANT_MIN_ROWS rows or
    more, the weights are dequantized to float32 from the packed codes and multiplied by
    F.linear instead: on CPUs without bfloat16 hardware the kernel's emulated arithmetic is
    several times slower there than float32, and float32 is also the exact reference.
    """

    DEQUANT_MIN_ROWS = 32

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, shape: tuple[int, int],
                 residual: torch.Tensor | None = None):
        self.packed, self.scales_zeros, self.shape = packed, scales_zeros, shape
        self.residual = residual         # (K/32, N, 2) bfloat16, or None
        self.can_dequantize = packed.device.type == "cpu" and shape[0] % CPU_PACK_ROWS == 0 and cpu_pack_layout_known()

    @classmethod
    def from_groups(cls, g: Int4Groups, device: torch.device, residual: bool = True) -> "Int4Weight":
        n, k = g.codes.shape
        codes = torch.from_numpy(g.codes)
        if device.type == "cuda":        # the CUDA kernel takes two codes per byte, even index high
            inner_k_tiles = 8 if k % 128 == 0 else 4 if k % 64 == 0 else 2      # K % (16 * tiles) == 0
            packed = torch.ops.aten._convert_weight_to_int4pack(
                (codes[:, ::2] << 4 | codes[:, 1::2]).to(device), inner_k_tiles)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
        exact = torch.stack([torch.from_numpy(g.scale).T, torch.from_numpy(g.zero).T], dim=-1)   # (K/32, N, 2)
        scales_zeros = exact.to(KERNEL_DTYPE)
        rest = (exact - scales_zeros.float()).to(KERNEL_DTYPE).contiguous().to(device) if residual else None
        return cls(packed, scales_zeros.contiguous().to(device), (n, k), rest)

    def __call__(self, x: torch.Tensor, decode_rows: int = 0) -> torch.Tensor:
        """x (T, K) -> (T, N) in x's dtype. The first `decode_rows` rows (decode and verify rows,
        named by the model runner) always go through the kernel, which computes each row on its
        own, so they round the same in any batch; the prompt rows after them are dequantized
        when there are DEQUANT_MIN_ROWS or more."""
        d = min(decode_rows, x.shape[0])
        if x.shape[0] - d >= self.DEQUANT_MIN_ROWS and self.can_dequantize:
            prompt = F.linear(x[d:], self.dequantize().to(x.dtype))
            return prompt if d == 0 else torch.cat([self._kernel(x[:d]), prompt])
        return self._kernel(x)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        hi = x.to(KERNEL_DTYPE)                              # (2n, K): x_hi rows, then x_lo rows
        split = torch.cat([hi, (x.float() - hi.float()).to(KERNEL_DTYPE)])
        y = self.mm(split, self.packed, GROUP, self.scales_zeros).float()
        if self.residual is not None:
            y[:n] += self.mm(hi, self.packed, GROUP, self.residual)
        return (y[:n] + y[n:]).to(x.dtype)

    @property
    def mm(self):
        return (torch.ops.aten._weight_int4pack_mm if self.packed.device.type == "cuda"
                else torch.ops.aten._weight_int4pack_mm_for_cpu)

    def dequantize(self) -> torch.Tensor:
        """The weights the kernel multiplies by, float32 (N, K), from the packed codes (CPU)."""
        n, k = self.shape
        assert self.can_dequantize, "the packed layout is known for CPU packs of 32-row blocks only"
        sz = self.scales_zeros.float()                                  # (K/32, N, 2)
        if self.residual is not None:
            sz = sz.add_(self.residual.float())
        codes = unpack_cpu_codes(self.packed, n, k).view(n, k // GROUP, GROUP)
        w = codes.float().sub_(8).mul_(sz[..., 0].T[..., None]).add_(sz[..., 1].T[..., None])
        return w.view(n, k)

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        n_scales = 2 if self.residual is not None else 1
        return self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * 2 * n_scales


class Int8Weight:
    """int8 codes (N, K) with one scale per row, in `levels` terms: level 2 quantizes what level
    1 left over (w = c1 * s1 + c2 * s2), about 16 bits of precision for 2 bytes a value. The
    output head (and the token table it shares) takes 2 levels: one scale for a whole row of a
    Q8_0 table (32 values a scale in the file) costs SmolLM2 about 5% of its top-1 predictions.
    With `split_activations` x goes in as two bfloat16 rows, x_hi + x_lo (about 16 bits), at
    the cost of M=2 instead of 1 in a memory-bound matvec: the head's bfloat16 rounding of x
    costs another 2-3% of top-1. The kernel's output is bfloat16 too (about 0.4% of a logit of
    20), so with `refine_top` the outputs within reach of each row's maximum are recomputed in
    float32 from the rows: the top of the distribution (what greedy decoding and top-k see) is
    then exact, the rest within bfloat16 rounding. Also serves embedding lookups (`rows`)."""

    REFINE_MARGIN = 2.0 ** -6       # of max |y|: 4x the bound on bfloat16 output rounding (2^-8)

    def __init__(self, codes: list[torch.Tensor], scales: list[torch.Tensor], split_activations: bool = False,
                 refine_top: bool = False):
        self.split_activations, self.refine_top = split_activations, refine_top
        self.codes = codes                                   # per level (N, K) int8
        self.scales = [s.float() for s in scales]            # per level (N,) float32, bf16-exact
        self.kernel_scales = [s.to(KERNEL_DTYPE) for s in scales]

    @classmethod
    def from_float(cls, weight: np.ndarray, device: torch.device, levels: int = 1,
                   split_activations: bool = False, refine_top: bool = False) -> "Int8Weight":
        codes, scales, rest = [], [], np.asarray(weight, dtype=np.float32)
        for _ in range(levels):
            c, s = int8_rows(rest)
            codes.append(torch.from_numpy(c).to(device))
            scales.append(torch.from_numpy(s).to(device))
            rest = rest - c.astype(np.float32) * s[:, None]
        return cls(codes, scales, split_activations, refine_top)

    def __call__(self, x: torch.Tensor, decode_rows: int = 0) -> torch.Tensor:
        flat = x.reshape(-1, self.codes[0].shape[1])
        n = flat.shape[0]
        hi = flat.to(KERNEL_DTYPE)
        if self.split_activations:                           # (2n, K): x_hi rows, then x_lo rows
            hi = torch.cat([hi, (flat.float() - hi.float()).to(KERNEL_DTYPE)])
        y = None
        for c, s in zip(self.codes, self.kernel_scales):
            part = torch.ops.aten._weight_int8pack_mm(hi, c, s).float()
            y = part if y is None else y.add_(part)
        if self.split_activations:
            y = y[:n] + y[n:]
        if self.refine_top:
            y = self._refine(flat.float(), y)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.codes[0].shape[0])

    def _refine(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (n, N) float32 from the kernel; recompute y[i, j] in float32 where it is within
        REFINE_MARGIN * max|y[i]| of max y[i]."""
        top = y.max(dim=-1, keepdim=True).values
        reach = y.abs().max(dim=-1, keepdim=True).values * self.REFINE_MARGIN
        rows, cols = torch.nonzero(y >= top - reach, as_tuple=True)        # (c,), (c,)
        y[rows, cols] = (self.rows(cols) * x[rows]).sum(-1)
        return y

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids, dequantized to float32: (len(ids), K)."""
        out = self.codes[0][ids].float().mul_(self.scales[0][ids, None])
        for c, s in zip(self.codes[1:], self.scales[1:]):
            out.add_(c[ids].float().mul_(s[ids, None]))
        return out

    def dequantize(self) -> torch.Tensor:
        return sum(c.float() * s[:, None] for c, s in zip(self.codes, self.scales))

    @property
    def device(self) -> torch.device:
        return self.codes[0].device

    @property
    def nbytes(self) -> int:
        return sum(c.numel() + s.numel() * 6 for c, s in zip(self.codes, self.scales))


class ConcatWeight:
    """Fused parts that are held in different formats (e.g. Q4_K q/k with a Q6_K v): one output."""

    def __init__(self, parts: list):
        self.parts = parts

    def __call__(self, x: torch.Tensor, decode_rows: int = 0) -> torch.Tensor:
        return torch.cat([part(x, decode_rows) for part in self.parts], dim=-1)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([part.dequantize().float() for part in self.parts])

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)


# --- building a (fused) weight from file tensors ------------------------------------------------
@dataclass
class FileTensor:
    """One tensor as the file stores it: raw blocks (rows, bytes per row) or plain values."""
    raw: np.ndarray
    qtype: QT
    shape: tuple[int, int]          # (N, K), numpy order

    def to_float(self) -> np.ndarray:
        if self.qtype in (QT.F32, QT.F16):             # a copy: the memory map is read-only
            return np.array(self.raw, dtype=np.float32)
        if self.qtype == QT.BF16:
            return (np.asarray(self.raw).astype(np.uint32) << 16).view(np.float32)
        return dequantize(self.raw, self.qtype).reshape(self.shape).astype(np.float32, copy=False)


def in_place(parts: list[FileTensor], device: torch.device, quantized: bool) -> bool:
    """Whether these tensors are used as the file stores them, by localrun's kernels
    (gguf_weight.py): on the CPU, when every part's type has a kernel."""
    if not quantized or device.type != "cpu":
        return False
    types = kernel_types()
    return all(p.qtype.name in types and p.raw.ndim == 2 and p.shape[1] % GROUP == 0 for p in parts)


def kind_of(t: FileTensor, device: torch.device, quantized: bool) -> str:
    """'int4', 'int8' or 'plain': how a tensor of this type is held on this device."""
    if quantized and t.qtype in INT4_TYPES and t.shape[1] % GROUP == 0 and int4_backend(device.type):
        return "int4"
    if quantized and t.qtype in INT8_TYPES and int8_backend(device.type):
        return "int8"
    return "plain"


def make_weight(parts: list[FileTensor], device: torch.device, dtype: torch.dtype, quantized: bool,
                math: WeightMath = WeightMath()):
    """The fused weight of parts stacked along N (e.g. q, k, v -> wqkv), held quantized where a
    kernel exists for all of them, else per part (ConcatWeight), else dequantized (PlainWeight).
    math: how in-place weights multiply rows (gguf_weight.WeightMath)."""
    if in_place(parts, device, quantized):
        return GGUFWeight([rows_tensor(p.raw) for p in parts], [int(p.qtype) for p in parts], parts[0].shape[1],
                          math)
    kinds = [kind_of(p, device, quantized) for p in parts]
    if len(set(kinds)) > 1:
        return ConcatWeight([make_weight([p], device, dtype, quantized, math) for p in parts])
    kind = kinds[0]
    if kind == "int4":
        groups = [int4_groups(p.raw, p.qtype, p.shape) for p in parts]
        fused = Int4Groups(*(np.concatenate([getattr(g, f) for g in groups]) for f in ("codes", "scale", "zero")))
        return Int4Weight.from_groups(fused, device)
    values = np.concatenate([p.to_float() for p in parts]) if len(parts) > 1 else parts[0].to_float()
    if kind == "int8":
        return Int8Weight.from_float(values, device)
    return PlainWeight(torch.from_numpy(np.ascontiguousarray(values)).to(device=device, dtype=dtype))


HEAD_INT8_LEVELS = 2


def make_embedding(t: FileTensor, device: torch.device, dtype: torch.dtype, quantized: bool,
                   math: WeightMath = WeightMath()):
    """The token table: two-level int8 rows for a quantized file tensor, so that a tied output
    head can share it (Int8Weight), else plain."""
    if in_place([t], device, quantized):
        return GGUFWeight([rows_tensor(t.raw)], [int(t.qtype)], t.shape[1], math)
    if quantized and t.qtype not in (QT.F32, QT.F16, QT.BF16):
        return Int8Weight.from_float(t.to_float(), device, levels=HEAD_INT8_LEVELS, split_activations=True,
                                     refine_top=True)
    return PlainWeight(torch.from_numpy(np.ascontiguousarray(t.to_float())).to(device=device, dtype=dtype))
