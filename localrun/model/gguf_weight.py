"""Weights used in place: the GGUF file's quantized rows, memory-mapped, multiplied by
localrun's compiled kernels (localrun/kernels). Nothing is converted at load, so resident
memory grows only by the pages a forward touches, and processes share the page cache.

How a weight multiplies its rows is a `WeightMath`, one per model (executor.build_model):
- Decode and verify rows (the first `decode_rows` rows of a call, which the model runner names)
  always go through the integer kernel: each activation row is rounded once to 8-bit blocks of
  32 (as ggml's q8_0) and multiplied with integer dot products, every row on its own, so a
  sequence's decode rows give the same bits whatever else shares the step.
- Prompt rows, with `prompt="int8"` (the default, EngineConfig.prompt_math): the same kernel, so
  a prompt row is computed as a decode row is, as llama.cpp computes every row, and faster
  than the float path (docs/measurements.md). Its error is that of 8-bit
  activations, llama.cpp's: mean KL 3.9e-3 (SmolLM2) and 2.3e-3 (gemma-3) from the exact float64
  model, llama.cpp's own 3.6e-3 and 5.5e-3 (docs/kernels.md); and since the rounding of one
  activation code can flip on a 1e-7 change of its input, a prompt split into other chunks
  (a prefix-cache hit, a restart from the disk cache) or a float16 instead of float32 KV cache
  draws that error again: the same text except at near-ties of the model.
- Prompt rows with `prompt="float32"`: float32 activations, the exact model to float32
  rounding. Below PROMPT_GEMM_MIN_ROWS rows the kernel multiplies them by the dequantized
  weight (qmatmul_f32); from there on the weight is dequantized to float32 a tile of rows at a
  time (PROMPT_TILE_BYTES) and multiplied by torch's GEMM into its columns of the output. The
  tile stays in cache and its buffer is reused from the heap: a whole weight dequantized at once
  (7-32 MB) came from fresh pages on every call (thousands of page faults each) and ran slower
  (figures in docs/kernels.md). Both compute the same product up to summation order, with no
  rounding step in between, so prompts split into other chunks agree to float32 rounding.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from localrun import kernels
from localrun.engine_config import DEFAULT_PROMPT_MATH

PROMPT_GEMM_MIN_ROWS = 32
PROMPT_TILE_BYTES = 2 << 20         # float32 bytes of one dequantized tile of weight rows
LANES_MIN_PARALLEL = 1              # sequences decoded together from which decode rows use the lane layout
Q8_0_LANES_MIN_PARALLEL = 2         # ... and Q8_0's (VNNI only), which cost more than its rows for one


@dataclass(frozen=True)
class WeightMath:
    """How a model's in-place weights multiply rows (the module's docstring says why)."""
    lanes: frozenset[int] = frozenset()   # the types whose integer-kernel rows use the lane layout (lane_types)
    prompt: str = DEFAULT_PROMPT_MATH     # prompt rows: "int8" (the integer kernel, as decode rows) or "float32"


def weight_math(n_parallel: int, prompt: str = DEFAULT_PROMPT_MATH) -> WeightMath:
    """The WeightMath of an engine built for n_parallel sequences on this host."""
    return WeightMath(lane_types(n_parallel), prompt)


def lane_types(n_parallel: int) -> frozenset[int]:
    """The GGML types whose decode rows use the integer kernel's lane layout (eight weight rows side
    by side, csrc/qmatmul_simd.h) rather than the row layout, in an engine built for n_parallel
    sequences. In decode steps the lanes are as fast as the rows with one sequence and faster the
    more there are (benchmarks/batched_decode.py --compare-layouts; docs/measurements.md), so
    every engine (LANES_MIN_PARALLEL = 1) uses them on AVX2. One engine uses one layout for every
    call, so a row's result never depends on what shares its step (the two layouts differ by
    summation order). AVX-512 hosts run the same lane kernel with VNNI's vpdpbusd for the steps
    (the same bits as AVX2's: the integer sums are exact either way), and AVX-VNNI hosts the AVX2
    kernels with vpdpbusd (the same bits again); see docs/kernels.md. Q8_0 has
    lanes with VNNI only (AVX-512's or AVX-VNNI's: the same bits), taken from 2 sequences on, where
    they beat the rows (one sequence is slower in lanes: gemma-3's 262k-row Q8_0 head;
    docs/measurements.md; SmolLM2's head on AVX-VNNI: 1.37x at one row, 0.57x at 16)."""
    isa = kernels.isa()
    if n_parallel < LANES_MIN_PARALLEL or isa not in ("avx2", "avxvnni", "avx512"):
        return frozenset()
    types = {kernels.KERNEL_TYPES[name] for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")}
    if isa in ("avxvnni", "avx512") and n_parallel >= Q8_0_LANES_MIN_PARALLEL:
        types.add(kernels.KERNEL_TYPES["Q8_0"])
    return frozenset(types)


def tile_rows(k: int) -> int:
    """Weight rows per dequantized tile of the prompt GEMM: about PROMPT_TILE_BYTES, a multiple of 16."""
    return max(16, PROMPT_TILE_BYTES // (4 * k) // 16 * 16)


def kernel_types() -> dict[str, int]:
    return kernels.KERNEL_TYPES if kernels.available() else {}


def rows_tensor(raw: np.ndarray) -> torch.Tensor:
    """A (rows, bytes per row) uint8 view of the file's bytes, no copy. The memory map is
    read-only and the kernels never write to it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)        # "the given NumPy array is not writable"
        return torch.from_numpy(raw)


class GGUFWeight:
    """Fused parts (q, k, v or gate, up) stacked along N, each (N_i, row bytes) in its file type."""

    def __init__(self, parts: list[torch.Tensor], qtypes: list[int], k: int, math: WeightMath = WeightMath()):
        self.parts, self.qtypes, self.k = parts, [int(q) for q in qtypes], k
        self.n = sum(p.shape[0] for p in parts)
        # the integer kernel's types: with kernels.LANES set for the lane layout (lane_types)
        self.kernel_types = [q | kernels.LANES if q in math.lanes else q for q in self.qtypes]
        self.prompt_int8 = math.prompt == "int8"

    def __call__(self, x: torch.Tensor, decode_rows: int = 0) -> torch.Tensor:
        """x (..., K) -> (..., N) in x's dtype."""
        flat = x.reshape(-1, self.k).float()
        d = min(decode_rows, flat.shape[0])
        if d == flat.shape[0] or self.prompt_int8:                  # every row through the integer kernel
            y = kernels.qmatmul(flat, self.parts, self.kernel_types)
        else:
            rest = flat[d:]
            prompt = (self._tiled_gemm(rest) if rest.shape[0] >= PROMPT_GEMM_MIN_ROWS
                      else kernels.qmatmul_f32(rest, self.parts, self.qtypes))
            y = prompt if d == 0 else torch.cat([kernels.qmatmul(flat[:d], self.parts, self.kernel_types), prompt])
        return y.to(x.dtype).reshape(*x.shape[:-1], self.n)

    def _tiled_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, K) float32 times the weight, dequantized one tile of rows at a time into the
        GEMM's columns: the same products as F.linear(x, self.dequantize())."""
        y = torch.empty(x.shape[0], self.n)
        step, col = tile_rows(self.k), 0
        for part, qtype in zip(self.parts, self.qtypes):
            for n0 in range(0, part.shape[0], step):
                tile = kernels.dequantize(part[n0:n0 + step], qtype, self.k)
                torch.mm(x, tile.T, out=y[:, col + n0:col + n0 + tile.shape[0]])
            col += part.shape[0]
        return y

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids dequantized, float32 (len(ids), K) (embedding lookups; one part only)."""
        assert len(self.parts) == 1
        return kernels.dequantize(self.parts[0][ids.cpu()].contiguous(), self.qtypes[0], self.k)

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 (N, K)."""
        parts = [kernels.dequantize(p, q, self.k) for p, q in zip(self.parts, self.qtypes)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def nbytes(self) -> int:
        return sum(p.numel() for p in self.parts)
