"""The devices a plan places work on: GPUs and the host, with the figures the speed model needs."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal


@dataclass(frozen=True)
class Device:
    name: str
    kind: Literal["gpu", "cpu"]
    total_bytes: int
    free_bytes: int                # what a plan may use before the margin
    memory_bandwidth: float        # bytes/s a decode step really reads at (not the datasheet peak)
    compute_flops: float           # matmul flop/s in the compute dtype, achievable (prompt chunks: big batches)
    link_bandwidth: float = 0.0    # host <-> device bytes/s (PCIe); 0 for the host
    link_latency_s: float = 10e-6  # per transfer across the link
    layer_overhead_s: float = 0.0  # fixed cost per layer per step besides its matmuls (norms, rope, dispatch)
    matmul_overhead_s: float = 0.0 # fixed cost of one matmul call (kernel launch, primitive set-up)
    step_overhead_s: float = 0.0   # host only: fixed cost of one forward step (embedding, sampling, Python)
    kv_bandwidth: float = 0.0      # bytes/s attention reads the KV cache at; 0: memory_bandwidth
    kv_cached_bytes: float = 0.0   # KV bytes a step reads that the device's caches hold from one step to the
                                   # next (read at no cost; only a step's KV beyond them at kv_bandwidth)
    kv_batch_bandwidth: float = 0.0  # bytes/s a decode step of kv_batch_rows rows or more reads its KV beyond the
    kv_batch_rows: int = 0           # caches at (linear in rows from one row's kv_bandwidth); 0: kv_bandwidth
    decode_flops: float = 0.0      # matmul flop/s over the few rows of a decode step (and the output head),
                                   # whose kernels compute row by row; 0: compute_flops
    unpack_bandwidth: float = 0.0  # bytes/s at which a prompt step unpacks quantized weights for its GEMM
                                   # (once per step, whatever its size); 0: weights are not unpacked
    attention_flops: float = 0.0   # flop/s of a prompt chunk's attention over cached tokens (and of a
                                   # sliding window's masked kernel); 0: compute_flops
    causal_attention_flops: float = 0.0  # flop/s of a prompt chunk's causal attention over its own tokens (a
                                         # causal kernel that skips the masked half); 0: attention_flops
    kv_decode_flops: tuple[tuple[str, float, float, int], ...] = ()  # (KV type, flop/s of one decode row's attention
                                                         # over a cache of that type, flop/s from `rows` rows on, rows)
                                                         # where it was measured: a quantized cache is widened in the
                                                         # kernel, compute its bytes do not show; else attention_flops
    source: str = "preset"         # where the figures come from: nvml, torch, preset, --vram, psutil, measured
    index: int | None = None       # the CUDA device index, for GPUs found on this machine

    def with_free(self, free_bytes: int) -> "Device":
        return replace(self, free_bytes=free_bytes, total_bytes=max(self.total_bytes, free_bytes))


@dataclass(frozen=True)
class Machine:
    """The devices of one machine: GPUs in the order layers flow through them, then the host."""
    gpus: tuple[Device, ...]
    host: Device

    @property
    def devices(self) -> tuple[Device, ...]:
        return (*self.gpus, self.host)
