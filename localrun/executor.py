"""Build the model the way this machine should run it: where each layer goes (layerplan's plan)
and whether the weights stay quantized.

Weights stay quantized (int4 / int8, torch's weight-only kernels) unless one of these asks for
the plain reference path, dequantized weights in the compute dtype:
- `quantized=False`, or the environment variable LOCALRUN_REFERENCE=1;
- an explicit dtype="float32": the kernels take bfloat16 activations, so float32 arithmetic
  in every matmul needs the dequantized weights.
"""
from __future__ import annotations

import os

import torch

from layerplan.kv_cache import default_kv_type
from localrun.engine_config import DEFAULT_PROMPT_MATH
from localrun.gguf_file import GGUFModelFile
from localrun.loader import file_weights, load_weights
from localrun.model.gguf_weight import weight_math
from localrun.model.llama import Transformer
from localrun.placement import DeviceMap, plan_device_map

REFERENCE_ENV = "LOCALRUN_REFERENCE"


def use_quantized(quantized: bool | None, dtype: torch.dtype | str | None) -> bool:
    """Whether to keep the file's quantized weights quantized (see the module docstring)."""
    if quantized is not None:
        return quantized
    if os.environ.get(REFERENCE_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    requested = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return requested != torch.float32


def build_model(file: GGUFModelFile, *, n_ctx: int, dtype: torch.dtype, quantized: bool,
                n_gpu_layers=None, device_map: DeviceMap | None = None, n_parallel: int = 1,
                kv_type: str | None = None, prompt_math: str = DEFAULT_PROMPT_MATH) -> Transformer:
    """The Transformer of `file` placed by `device_map`, or by layerplan for `n_gpu_layers`
    ('auto', None or a number; all-CPU on a machine without a GPU), with the plan's KV budget
    per device for the engine's pool. kv_type: the engine's (None: the default for `dtype`,
    layerplan.kv_cache.default_kv_type). prompt_math: how quantized weights multiply prompt
    rows (EngineConfig.prompt_math, model/gguf_weight.py)."""
    if device_map is None:
        device_map = plan_device_map(file.profile, n_gpu_layers, n_ctx=n_ctx, n_parallel=n_parallel,
                                     kv_type=kv_type or default_kv_type(dtype),
                                     use_gpus=torch.cuda.is_available())
    if quantized:
        weights = file_weights(file)
    else:
        weights = load_weights(file, dtype)
    model = Transformer(file.config, weights, max_positions=n_ctx, device_map=device_map,
                        quantized=quantized, dtype=dtype,
                        math=weight_math(n_parallel, prompt_math))
    del weights
    release_free_memory()
    return model


def release_free_memory() -> None:
    """Hand the heap the loader freed (per-layer conversion temporaries) back to the OS: glibc
    keeps freed small blocks for reuse, which would count as resident memory for nothing.
    A no-op where the C library has no malloc_trim."""
    import ctypes
    import ctypes.util
    import gc
    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
