"""Find this machine's devices: NVIDIA GPUs through NVML, the host through psutil.

When NVML is missing, a CUDA build of torch (if installed) is asked instead; whether the
installed torch is a CUDA build is read from its version file, so a CPU-only torch is never
imported just to learn that there is no GPU.
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from layerplan.devices import Device, Machine
from layerplan.gpu_presets import (BANDWIDTH_EFFICIENCY, COMPUTE_EFFICIENCY, GENERIC, GPU_LAYER_OVERHEAD_S,
                                   GPU_MATMUL_OVERHEAD_S, pcie_bandwidth, preset_for_name)

HOST_BANDWIDTH_PER_CORE = 8e9   # bytes/s one core streams; a desktop saturates near the cap
HOST_BANDWIDTH_CAP = 60e9       # dual-channel DDR5, as decode really reads it
HOST_FLOPS_PER_CORE = 40e9      # AVX2/AVX-512 f32 matmul, achievable
HOST_LAYER_OVERHEAD_S = 30e-6   # per layer per step besides matmuls: thread barriers, op dispatch
HOST_MATMUL_OVERHEAD_S = 5e-6   # one matmul call


def host_device(total_bytes: int, available_bytes: int, n_cores: int, source: str = "psutil") -> Device:
    """The host as a device, with default figures for its bandwidth and compute."""
    return Device(
        name="CPU", kind="cpu", total_bytes=total_bytes, free_bytes=available_bytes,
        memory_bandwidth=min(HOST_BANDWIDTH_CAP, HOST_BANDWIDTH_PER_CORE * n_cores),
        compute_flops=HOST_FLOPS_PER_CORE * n_cores, layer_overhead_s=HOST_LAYER_OVERHEAD_S,
        matmul_overhead_s=HOST_MATMUL_OVERHEAD_S, source=source,
    )


def probe_host() -> Device:
    import psutil

    memory = psutil.virtual_memory()
    cores = psutil.cpu_count(logical=False) or psutil.cpu_count() or 1
    return host_device(memory.total, memory.available, cores)


def _gpu_device(name: str, index: int, total: int, free: int, bandwidth_peak: float | None,
                pcie: tuple[int, int] | None, source: str) -> Device:
    preset = preset_for_name(name) or GENERIC
    bandwidth = bandwidth_peak or preset.bandwidth_gb_s * 1e9
    gen, lanes = pcie or (preset.pcie_gen, preset.pcie_lanes)
    return Device(
        name=name.removeprefix("NVIDIA ").removeprefix("GeForce ").strip(), kind="gpu", total_bytes=total, free_bytes=free,
        memory_bandwidth=bandwidth * BANDWIDTH_EFFICIENCY,
        compute_flops=preset.f16_tflops * 1e12 * COMPUTE_EFFICIENCY,
        link_bandwidth=pcie_bandwidth(gen, lanes), layer_overhead_s=GPU_LAYER_OVERHEAD_S,
        matmul_overhead_s=GPU_MATMUL_OVERHEAD_S,
        source=source, index=index,
    )


def probe_gpus_nvml(pynvml=None) -> tuple[Device, ...] | None:
    """Every NVIDIA GPU through NVML; None when NVML cannot be used here."""
    try:
        if pynvml is None:
            import pynvml
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                clock_mhz = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM)
                bus_bits = pynvml.nvmlDeviceGetMemoryBusWidth(handle)
                bandwidth = clock_mhz * 1e6 * 2 * bus_bits / 8  # double data rate
            except Exception:
                bandwidth = None
            try:
                pcie = (pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle), pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle))
            except Exception:
                pcie = None
            gpus.append(_gpu_device(name, index, memory.total, memory.free, bandwidth, pcie, "nvml"))
        return tuple(gpus)
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def installed_torch_is_cuda_build() -> bool:
    """True when an importable torch was built with CUDA, read from its version file without importing it."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return False
    version_file = Path(spec.origin).parent / "version.py"
    try:
        text = version_file.read_text()
    except OSError:
        return False
    match = re.search(r"^cuda\s*(?::[^=]*)?=\s*(.+)$", text, re.MULTILINE)
    return bool(match) and match.group(1).strip() not in ("None", "''", '""')


def probe_gpus_torch() -> tuple[Device, ...]:
    """GPUs through torch.cuda, only when a CUDA build of torch is installed."""
    if not installed_torch_is_cuda_build():
        return ()
    try:
        import torch

        if not torch.cuda.is_available():
            return ()
        gpus = []
        for index in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(index)
            gpus.append(_gpu_device(torch.cuda.get_device_name(index), index, total, free, None, None, "torch"))
        return tuple(gpus)
    except Exception:
        return ()


def probe_machine() -> Machine:
    """This machine's GPUs (NVML, else a CUDA torch, else none) and host."""
    gpus = probe_gpus_nvml()
    if gpus is None:
        gpus = probe_gpus_torch()
    return Machine(gpus=gpus, host=probe_host())
