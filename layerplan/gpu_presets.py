"""Datasheet figures of common GPUs, for planning a machine you are not on (`--gpu rtx4090`).

Memory is what the card has; bandwidth and compute are datasheet peaks (dense f16 tensor
throughput with f16 accumulation, the path llama.cpp's cuBLAS matmuls take), scaled by the efficiencies below to what a decode or
prefill step really reaches. `localrun plan --measure` replaces them with measured figures
for the GPUs of this machine.
"""
from __future__ import annotations

from dataclasses import dataclass

from layerplan.devices import Device
from layerplan.units import GiB

BANDWIDTH_EFFICIENCY = 0.75   # share of peak memory bandwidth a decode matvec reads at
COMPUTE_EFFICIENCY = 0.6      # share of peak tensor throughput a prefill matmul reaches
LINK_EFFICIENCY = 0.8         # share of the PCIe line rate a transfer reaches
PCIE_LANE_BYTES_S = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9}
GPU_LAYER_OVERHEAD_S = 20e-6  # norms, rope, attention launches per layer per step
GPU_MATMUL_OVERHEAD_S = 5e-6  # one matmul kernel launch


@dataclass(frozen=True)
class GPUPreset:
    key: str
    name: str
    memory_bytes: int
    bandwidth_gb_s: float     # datasheet memory bandwidth, GB/s
    f16_tflops: float         # datasheet dense f16 tensor throughput (f16 accumulate), TFLOPS
    pcie_gen: int
    pcie_lanes: int

    def device(self, free_bytes: int | None = None, source: str = "preset") -> Device:
        free = self.memory_bytes if free_bytes is None else free_bytes
        return Device(
            name=self.name, kind="gpu", total_bytes=max(self.memory_bytes, free), free_bytes=free,
            memory_bandwidth=self.bandwidth_gb_s * 1e9 * BANDWIDTH_EFFICIENCY,
            compute_flops=self.f16_tflops * 1e12 * COMPUTE_EFFICIENCY,
            link_bandwidth=pcie_bandwidth(self.pcie_gen, self.pcie_lanes),
            layer_overhead_s=GPU_LAYER_OVERHEAD_S, matmul_overhead_s=GPU_MATMUL_OVERHEAD_S, source=source,
        )


def pcie_bandwidth(generation: int, lanes: int) -> float:
    """Achievable one-way bytes/s of a PCIe link."""
    return PCIE_LANE_BYTES_S.get(generation, PCIE_LANE_BYTES_S[4]) * lanes * LINK_EFFICIENCY


GPU_PRESETS: dict[str, GPUPreset] = {p.key: p for p in (
    GPUPreset("rtx5090", "RTX 5090", 32 * GiB, 1792, 209.5, 5, 16),
    GPUPreset("rtx5080", "RTX 5080", 16 * GiB, 960, 112.6, 5, 16),
    GPUPreset("rtx4090", "RTX 4090", 24 * GiB, 1008, 165.2, 4, 16),
    GPUPreset("rtx4080", "RTX 4080", 16 * GiB, 717, 97.5, 4, 16),
    GPUPreset("rtx4070ti", "RTX 4070 Ti", 12 * GiB, 504, 80.2, 4, 16),
    GPUPreset("rtx4070", "RTX 4070", 12 * GiB, 504, 58.3, 4, 16),
    GPUPreset("rtx4060ti-16", "RTX 4060 Ti 16GB", 16 * GiB, 288, 44.1, 4, 8),
    GPUPreset("rtx4060ti-8", "RTX 4060 Ti 8GB", 8 * GiB, 288, 44.1, 4, 8),
    GPUPreset("rtx4060", "RTX 4060", 8 * GiB, 272, 30.1, 4, 8),
    GPUPreset("rtx3090", "RTX 3090", 24 * GiB, 936, 71, 4, 16),
    GPUPreset("rtx3080", "RTX 3080 10GB", 10 * GiB, 760, 59.5, 4, 16),
    GPUPreset("rtx3060", "RTX 3060 12GB", 12 * GiB, 360, 51.2, 4, 16),
    GPUPreset("a100-40", "A100 40GB", 40 * GiB, 1555, 312, 4, 16),
    GPUPreset("a100-80", "A100 80GB", 80 * GiB, 2039, 312, 4, 16),
    GPUPreset("h100-80", "H100 80GB", 80 * GiB, 3350, 989, 5, 16),
    GPUPreset("h200", "H200", 141 * 10**9, 4800, 989, 5, 16),
    GPUPreset("l4", "L4", 24 * GiB, 300, 121, 4, 16),
    GPUPreset("l40s", "L40S", 48 * GiB, 864, 362, 4, 16),
    GPUPreset("a6000", "RTX A6000", 48 * GiB, 768, 155, 4, 16),
    GPUPreset("t4", "Tesla T4", 16 * GiB, 320, 65, 3, 16),
)}
# a GPU given only as `--vram 24GiB`: figures of a typical desktop card of this decade
GENERIC = GPUPreset("generic", "GPU", 0, 700, 80, 4, 16)


def gpu_preset(key: str) -> GPUPreset:
    key = key.strip().lower().replace(" ", "")
    if key not in GPU_PRESETS:
        raise ValueError(f"unknown GPU '{key}'; known: {', '.join(GPU_PRESETS)}")
    return GPU_PRESETS[key]


def preset_for_name(name: str) -> GPUPreset | None:
    """The preset whose model number appears in a driver's device name ('NVIDIA GeForce RTX 4090')."""
    flat = name.lower().replace(" ", "").replace("-", "")
    best = None
    for preset in GPU_PRESETS.values():
        token = preset.key.split("-")[0]
        if token in flat and (best is None or len(token) > len(best.key.split("-")[0])):
            best = preset
    if best and best.key.startswith(("rtx4060ti", "a100")):
        gib = 16 if "16" in flat else 8
        if best.key.startswith("a100"):
            best = GPU_PRESETS["a100-80" if "80" in flat else "a100-40"]
        else:
            best = GPU_PRESETS[f"rtx4060ti-{gib}"]
    return best
