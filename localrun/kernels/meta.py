"""The output shapes of the decode step's ops (fake implementations), so `torch.compile` can
trace calls to them: torch's tracer runs each op on tensors without data and needs to know what
comes out. Nothing in localrun compiles (below), so they are not registered at start-up: whoever
traces calls `register()` once the library is loaded (benchmarks/compile_decode.py, the tests).

Whether compiling the decode step pays was measured (benchmarks/compile_decode.py,
docs/kernels.md "torch.compile of the decode step"): it does not, so nothing compiles it; these
shapes keep the ops traceable for whoever measures again.
"""
from __future__ import annotations

import torch


def _rows(x: torch.Tensor, weights: list[torch.Tensor], qtypes: list[int]) -> torch.Tensor:
    """qmatmul / qmatmul_f32: x (M, K) times the weights' rows, concatenated: (M, sum of rows)."""
    return x.new_empty(x.shape[0], sum(w.shape[0] for w in weights), dtype=torch.float32)


def _like(x: torch.Tensor, *args) -> torch.Tensor:
    return torch.empty_like(x)


def _act_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu_mul / gelu_mul: (T, 2F) -> (T, F)."""
    return gu.new_empty(gu.shape[0], gu.shape[1] // 2)


def _add_rms_norm(x, r, w, eps):
    return torch.empty_like(x), torch.empty_like(x)


def _paged_attention(q, *args, **kwargs) -> torch.Tensor:
    """(T, H, hd) float32, whatever q's strides."""
    return q.new_empty(q.shape, dtype=torch.float32)


FAKES = {
    "dequantize": lambda w, qtype, k: w.new_empty(w.shape[0], k, dtype=torch.float32),
    "qmatmul": _rows,
    "qmatmul_f32": _rows,
    "decode_block": _like,
    "rms_norm": _like,
    "add_rms_norm": _add_rms_norm,
    "silu_mul": _act_mul,
    "gelu_mul": _act_mul,
    "rope": lambda x, freqs, neox: x.new_empty(x.shape),
    "paged_attention": _paged_attention,
}


def register() -> None:
    """Register FAKES for the loaded library's ops: those it has (an older build loaded through
    LOCALRUN_KERNEL_LIBRARY, as benchmarks/kernel_ab.py does, may lack some) and that have none yet."""
    for name, fake in FAKES.items():
        if not hasattr(torch.ops.localrun, name):
            continue
        try:
            torch.library.register_fake(f"localrun::{name}")(fake)
        except RuntimeError:                  # registered already (a library loaded twice)
            pass
