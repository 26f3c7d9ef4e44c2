"""Compute and scratch buffers: the memory besides weights and KV cache, as a function of
context, batch and vocabulary.

Sized like llama.cpp's graph allocator reserves them for the worst step (a full ubatch):
f32 activations of the widest part of a layer, the attention mask, a dequantized copy of one
layer's K and V when the KV type is quantized, and the ubatch's logits on the device that
holds the output head. A GPU also pays its CUDA context.
"""
from __future__ import annotations

from dataclasses import dataclass

from layerplan.model_profile import ModelProfile
from layerplan.settings import PlanSettings
from layerplan.units import MiB

CUDA_CONTEXT_BYTES = 384 * MiB  # CUDA context, cuBLAS workspace and memory-pool slack per GPU
F32, F16 = 4, 2


def activation_bytes(profile: ModelProfile, n_ubatch: int) -> int:
    """f32 activations of one ubatch through the widest part of a layer (attention or FFN)."""
    layer = max(profile.layers, key=lambda l: l.n_head * l.head_dim_k)
    q_dim = layer.n_head * layer.head_dim_k
    kv_dim = layer.n_kv_head * (layer.head_dim_k + layer.head_dim_v)
    widest = max(2 * q_dim + kv_dim, 3 * profile.n_ff)
    return n_ubatch * F32 * (2 * profile.d_model + widest)


def attention_scratch_bytes(profile: ModelProfile, settings: PlanSettings) -> int:
    """The mask (and, without flash attention, the scores) of one ubatch against the whole cache."""
    n_kv, n_ub = settings.n_kv_tokens, settings.n_ubatch
    scratch = n_kv * n_ub * F16  # KQ mask
    if not settings.flash_attention:
        scratch += n_kv * n_ub * max(l.n_head for l in profile.layers) * F32
    if settings.kv.quantized:  # dequantized to f16 for a prefill step
        widest = max(l.n_kv_head * (l.head_dim_k + l.head_dim_v) for l in profile.layers)
        scratch += n_kv * widest * F16
    return scratch


def head_buffer_bytes(profile: ModelProfile, settings: PlanSettings) -> int:
    """Logits of a full ubatch, on the device that runs the output head."""
    return settings.n_ubatch * profile.n_vocab * F32


@dataclass(frozen=True)
class BufferModel:
    """The buffer sizes of one model at one setting, so that placement adds them up cheaply."""
    activation_bytes: int
    attention_scratch_bytes: int
    head_bytes: int
    host_io_bytes: int
    cuda_context_bytes: int = CUDA_CONTEXT_BYTES

    @classmethod
    def of(cls, profile: ModelProfile, settings: PlanSettings) -> "BufferModel":
        return cls(activation_bytes(profile, settings.n_ubatch), attention_scratch_bytes(profile, settings),
                   head_buffer_bytes(profile, settings), host_io_bytes(profile, settings))

    def device_bytes(self, *, is_gpu: bool, n_layers: int, holds_head: bool, holds_kv: bool) -> int:
        """Buffers on a device that runs `n_layers` layers (and the head, if `holds_head`); the host
        always also holds the input embeddings and the returned logits."""
        total = 0 if is_gpu else self.host_io_bytes
        if not n_layers and not holds_head and not holds_kv:
            return total
        if n_layers or holds_head:
            total += self.activation_bytes
        if n_layers or holds_kv:
            total += self.attention_scratch_bytes
        if holds_head:
            total += self.head_bytes
        if is_gpu:
            total += self.cuda_context_bytes
        return total


def host_io_bytes(profile: ModelProfile, settings: PlanSettings) -> int:
    """Host buffers that exist in every plan: the input embeddings of a ubatch, and the logits
    handed back to the sampler (one row per sequence)."""
    return settings.n_ubatch * profile.d_model * F32 + settings.n_parallel * profile.n_vocab * F32
