"""localrun's compiled CPU kernels, as torch custom ops (`torch.ops.localrun.*`).

- `qmatmul(x, weights, qtypes)`: x (M, K) float32 times GGUF-quantized weight rows used in place
  (the file's bytes, memory-mapped): each activation row is quantized once to 8-bit blocks and
  multiplied with integer dot products (AVX2 maddubs, AVX-512 VNNI vpdpbusd). Several weights
  with the same K (q, k, v) form one fused output.
- `dequantize(w, qtype, k)`: the float32 values of a weight (the prompt path's GEMM and tests).
- `qmatmul_f32(x, weights, qtypes)`: the same product with float32 activations (prompt rows).
- `rms_norm`, `add_rms_norm`, `silu_mul` (csrc/small_ops.cpp): fused small ops of a block.
- `topk(x, n)` (csrc/topk.cpp): the sampler's candidates, one pass over a row of logits.
- `attention_bf16(q, k, v, offset, scale)` (csrc/prompt_attention.cpp): prompt rows' attention
  with bfloat16 products and float32 sums (AVX-512 BF16 only: `has_attention_bf16()`);
  `attention_f32`, the same in float32 with FMA (AVX2: `has_attention_f32()`);
  `attention_shared_bf16` / `_f32`, the same for several sequences' rows over one shared prefix
  (cascade attention, each row's bits those of the one-call kernel); `attention_paged` and
  `attention_shared_paged`, the same over keys read where they lie in the engine's pool;
  `prompt_attention_kind()` names the one the model uses here.

Block layouts: csrc/blocks.h. Scalar reference: csrc/ref.h. Design and figures: docs/kernels.md.
The library is compiled by set-up (`python -m localrun.kernels.build`); if it is missing it is
compiled on first use. LOCALRUN_NO_KERNELS=1 turns the kernels off (torch's path runs, with a
warning), LOCALRUN_ISA=avx512|avxvnni|avx2|ref forces an instruction set (avxvnni on an
AVX-512 host without AVX-VNNI: the same kernels through vpdpbusd's EVEX form), and
LOCALRUN_KERNEL_LIBRARY=path loads that library instead (another build of the kernels:
benchmarks/kernel_ab.py).
"""
from __future__ import annotations

import hashlib
import os
import sys
from functools import lru_cache
from pathlib import Path

import torch

from layerplan.ggml_types import GGML_TYPES_BY_NAME
from layerplan.ledger import ENGINE_KERNEL_TYPES
from localrun.kernels.build import BuildError, build, library_path

# GGML type ids with a kernel (gguf's GGMLQuantizationType values), by name ("Q4_0": 2): the types
# layerplan's ledger counts as multiplied in place, written down there (torch-free)
KERNEL_TYPES = {name.upper(): GGML_TYPES_BY_NAME[name].id
                for name in sorted(ENGINE_KERNEL_TYPES, key=lambda name: GGML_TYPES_BY_NAME[name].id)}
# Set in a type passed to qmatmul: multiply in the lane layout (eight weight rows side by side;
# localrun/model/gguf_weight.py: lane_types): AVX2 and AVX-512 give the same bits (Q8_0 has
# lanes on AVX-512 only); the scalar reference has the row layout only.
LANES = 1 << 8


@lru_cache(maxsize=None)
def available() -> bool:
    """Whether the compiled kernels are loaded (says why once on stderr when they are not)."""
    if os.environ.get("LOCALRUN_NO_KERNELS") == "1":
        print("localrun: LOCALRUN_NO_KERNELS=1: running without the compiled kernels (slower)", file=sys.stderr)
        return False
    try:
        torch.ops.load_library(os.environ.get("LOCALRUN_KERNEL_LIBRARY") or str(build(quiet=True)))
        torch.ops.localrun.isa()                      # LOCALRUN_ISA is checked here
    except (BuildError, OSError, RuntimeError) as e:
        print(f"localrun: the compiled kernels are unavailable ({e}); running without them (slower)",
              file=sys.stderr)
        return False
    return True


@lru_cache(maxsize=None)
def signature() -> str:
    """What of the compiled kernels decides the bits they compute: which library (its sources'
    key, or a digest of the file LOCALRUN_KERNEL_LIBRARY names), the instruction set its matmuls
    run and LOCALRUN_ISA as given (each kernel file reads it for itself: on an AVX-512 CPU without
    VNNI the matmuls run AVX2 and the paged attention AVX-512 unless it says avx2); 'none' without
    them. Two builds, or AVX2 against AVX-512, round differently."""
    if not available():
        return "none"
    given = os.environ.get("LOCALRUN_KERNEL_LIBRARY")
    library = hashlib.sha256(Path(given).read_bytes()).hexdigest()[:16] if given else library_path().parent.name
    return f"{library}|{isa()}|{os.environ.get('LOCALRUN_ISA', '')}"


def isa() -> str | None:
    """The instruction set the kernels run ('avx512', 'avxvnni', 'avx2', 'ref'), or None without kernels."""
    return torch.ops.localrun.isa() if available() else None


def qmatmul(x: torch.Tensor, weights: list[torch.Tensor], qtypes: list[int]) -> torch.Tensor:
    return torch.ops.localrun.qmatmul(x, weights, qtypes)


def dequantize(w: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    return torch.ops.localrun.dequantize(w, qtype, k)


def qmatmul_f32(x: torch.Tensor, weights: list[torch.Tensor], qtypes: list[int]) -> torch.Tensor:
    """As qmatmul, with x kept in float32 (no 8-bit rounding of the activations)."""
    return torch.ops.localrun.qmatmul_f32(x, weights, qtypes)


def gather_kv(data: torch.Tensor, scale: torch.Tensor | None, block_ids: torch.Tensor, num_tokens: int,
              block_size: int, group: int = 1, per_block: bool = False) -> torch.Tensor:
    """The first num_tokens tokens of a float16 or int8 KV pool's blocks block_ids as float32
    (tokens, n_kv, hd): float16 widened; int8 as code x scale, per block and channel (per_block)
    or per group of a token's values."""
    return torch.ops.localrun.gather_kv(data, scale, block_ids, num_tokens, block_size, group, per_block)


def write_kv(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor, block_size: int,
             per_block: bool = False, fp8: bool = False) -> None:
    """Write one sequence's rows x (T, n_kv, hd) float32 at slots of an int8 or fp8 KV pool as the
    stores do: per_block (int8 K): every block written requantized whole, one scale per channel;
    else one scale per group of a token's values (scale (slots, n_kv, hd / group))."""
    torch.ops.localrun.write_kv(x, data, scale, slots, block_size, per_block, fp8)


def topk(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n largest of a (V,) float32 row in descending order, ties lowest index first, and their
    ids, in one pass on the calling thread (a row with a NaN goes to torch.topk)."""
    return torch.ops.localrun.topk(x, n)


@lru_cache(maxsize=None)
def has_attention_bf16() -> bool:
    """Whether attention_bf16 runs here: the kernels are loaded, the CPU has AVX-512 BF16, and
    LOCALRUN_ISA does not force a narrower instruction set."""
    return available() and bool(torch.ops.localrun.has_attention_bf16())


# The prompt attention kernels walk a row's keys in blocks of this many positions, on a grid
# fixed by the positions (key j of a call is at grid key lead + j, lead = its position mod
# PROMPT_KEY_BLOCK), so a row's bits do not depend on where the caller's keys start.
PROMPT_KEY_BLOCK = 64


def attention_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int,
                   scale: float, window: int = 0, lead: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries q (T, Hq, hd) over keys and values (Hkv, L, hd), float32, query i seeing keys
    0 .. offset + i (offset < 0: all of them; window > 0: only the last `window` of those),
    scores scaled by `scale`: the output (T, Hq, hd)
    and the natural log-sum-exp of each row's scores (T, Hq), both float32. Queries, keys, values
    and softmax weights are rounded to bfloat16 before they multiply; sums stay float32.
    lead: the position of key 0 mod PROMPT_KEY_BLOCK (the key grid)."""
    return torch.ops.localrun.attention_bf16(q, k, v, offset, scale, window, lead)


def attention_shared_bf16(q: torch.Tensor, k_pre: torch.Tensor, v_pre: torch.Tensor, k_own: list[torch.Tensor],
                          v_own: list[torch.Tensor], rows: list[int], scale: float) -> torch.Tensor:
    """Cascade attention of several sequences' prompt rows: q (sum of rows, Hq, hd) holds
    rows[s] queries of sequence s in turn; every sequence's keys are the shared k_pre, v_pre
    (Hkv, S, hd; S a multiple of PROMPT_KEY_BLOCK, packed once) and then its own k_own[s],
    v_own[s] (Hkv, L_s, hd), its query i seeing keys up to S + L_s - rows[s] + i. Each row's
    output (sum of rows, Hq, hd) has the bits attention_bf16 gives it over its keys in one call."""
    return torch.ops.localrun.attention_shared_bf16(q, k_pre, v_pre, k_own, v_own, rows, scale)


def attention_paged(kind: str, q: torch.Tensor, keys, key0: int, num_keys: int, offset: int, scale: float,
                    window: int = 0, lead: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_bf16 or attention_f32 (kind) over keys and values that lie in the engine's pool
    (`keys`: paged_kv.PoolKeys; a float32, float16 or bfloat16 pool, or int8 / fp8 codes with their
    scales): key j is the position keys.first + key0 + j, read where it lies; the same bits as over
    those keys gathered (codes times their scales, as the stores' read computes them)."""
    return getattr(torch.ops.localrun, f"attention_paged_{kind}")(
        q, keys.k_pool, keys.v_pool, keys.blocks, keys.block_size, key0, num_keys, offset, scale, window, lead,
        keys.k_scale, keys.v_scale)


def attention_shared_paged(kind: str, q: torch.Tensor, prefix, own: list, rows: list[int], scale: float) -> torch.Tensor:
    """attention_shared_bf16 or _f32 (kind) over keys in the engine's pool: `prefix`, the shared
    keys (a PoolKeys from position 0, a multiple of PROMPT_KEY_BLOCK of them), and each
    sequence's own keys after them (`own`: PoolKeys from the prefix's end), in the same pools."""
    return getattr(torch.ops.localrun, f"attention_shared_paged_{kind}")(
        q, prefix.k_pool, prefix.v_pool, prefix.blocks, prefix.num_tokens, [keys.blocks for keys in own],
        [keys.num_tokens for keys in own], rows, prefix.block_size, scale, prefix.k_scale, prefix.v_scale)


@lru_cache(maxsize=None)
def has_attention_f32() -> bool:
    """Whether attention_f32 runs here: the kernels are loaded, the CPU has AVX2 and FMA, and
    LOCALRUN_ISA does not force the scalar reference."""
    return available() and bool(torch.ops.localrun.has_attention_f32())


def attention_f32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int,
                  scale: float, window: int = 0, lead: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """As attention_bf16, with no rounding of the inputs: float32 products and sums (FMA)."""
    return torch.ops.localrun.attention_f32(q, k, v, offset, scale, window, lead)


def attention_shared_f32(q: torch.Tensor, k_pre: torch.Tensor, v_pre: torch.Tensor, k_own: list[torch.Tensor],
                         v_own: list[torch.Tensor], rows: list[int], scale: float) -> torch.Tensor:
    """As attention_shared_bf16, in float32 (attention_f32's bits)."""
    return torch.ops.localrun.attention_shared_f32(q, k_pre, v_pre, k_own, v_own, rows, scale)


def prompt_attention_kind() -> str | None:
    """The prompt attention kernel of this host: "bf16" (attention_bf16, AVX-512 BF16), else
    "f32" (attention_f32, AVX2), else None (torch's flash attention)."""
    return "bf16" if has_attention_bf16() else "f32" if has_attention_f32() else None
