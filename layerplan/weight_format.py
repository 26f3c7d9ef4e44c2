"""A profile re-expressed for a runtime that stores weights differently from the file.

llama.cpp keeps a GGUF's tensors as stored, so a plan for it uses the file's bytes. A runtime
that dequantizes matrices into its compute dtype (localrun's engine does, into bf16, until
its quantized kernels land) holds params x dtype bytes per matrix instead; 1-D tensors
(norms, biases) stay f32. `as_weight_dtype(profile, "bf16")` gives the profile that runtime
really holds, for planning it or predicting its resident memory.
"""
from __future__ import annotations

from dataclasses import replace

from layerplan.model_profile import ModelProfile

DTYPE_BYTES = {"f32": 4, "float32": 4, "f16": 2, "float16": 2, "bf16": 2, "bfloat16": 2, "int8": 1}
F32 = 4


def as_weight_dtype(profile: ModelProfile, dtype: str, n_matmuls_per_layer: int | None = None) -> ModelProfile:
    """`profile` with every matrix stored as `dtype` (f32, f16, bf16, int8) and vectors as f32.
    `n_matmuls_per_layer` is the runtime's matmul calls per layer when it fuses weights
    (localrun fuses q/k/v and gate/up: 4); None keeps one call per matrix."""
    key = dtype.lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown weight dtype '{dtype}'; use one of {', '.join(DTYPE_BYTES)}")
    size = DTYPE_BYTES[key]
    layers = tuple(replace(layer, weight_bytes=layer.params * size + layer.vector_bytes,
                           expert_bytes=layer.expert_params * size,
                           n_matmuls=layer.n_matmuls if n_matmuls_per_layer is None else n_matmuls_per_layer)
                   for layer in profile.layers)
    embedding = profile.head_params * size
    output_norm = F32 * profile.d_model
    output = output_norm + (0 if profile.tied_embeddings else profile.head_params * size)
    return replace(profile, layers=layers, embedding_bytes=embedding, output_bytes=output,
                   head_bytes=output + (embedding if profile.tied_embeddings else 0),
                   quantization=f"{profile.quantization} as {key}")
