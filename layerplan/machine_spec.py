"""The machine to plan for: this one (probed), or one described on the command line
(`--vram 24GiB` per GPU, `--gpu rtx4090` presets, `--ram 64GiB`)."""
from __future__ import annotations

from dataclasses import replace

from layerplan.calibrate import Calibration, apply
from layerplan.devices import Device, Machine
from layerplan.gpu_presets import GENERIC, gpu_preset
from layerplan.probe import probe_gpus_nvml, probe_gpus_torch, probe_host
from layerplan.units import parse_bytes


def simulated_gpus(vram: list[str], gpu: list[str]) -> tuple[Device, ...]:
    """GPUs from presets and/or memory sizes. With both, the i-th --vram is the i-th --gpu's free
    memory (a single --vram applies to every --gpu)."""
    sizes = [parse_bytes(v) for v in vram]
    if gpu:
        presets = [gpu_preset(g) for g in gpu]
        if sizes and len(sizes) not in (1, len(presets)):
            raise ValueError(f"{len(sizes)} --vram values for {len(presets)} --gpu presets; give one, or one per GPU")
        frees = sizes * len(presets) if len(sizes) == 1 else sizes or [None] * len(presets)
        return tuple(p.device(free) for p, free in zip(presets, frees))
    return tuple(GENERIC.device(size, source="--vram, typical desktop figures") for size in sizes)


def build_machine(vram: list[str] | None = None, gpu: list[str] | None = None, ram: str | None = None,
                  calibration: Calibration | None = None, probe_gpus: bool = True) -> Machine:
    """The machine a plan is for. Without --vram/--gpu the GPUs are probed; the host is always this
    one's CPU (calibrated when a calibration is given), with --ram replacing its memory."""
    vram, gpu = list(vram or []), list(gpu or [])
    if vram or gpu:
        gpus = simulated_gpus(vram, gpu)
    elif probe_gpus:
        found = probe_gpus_nvml()
        gpus = found if found is not None else probe_gpus_torch()
    else:
        gpus = ()
    machine = Machine(gpus=gpus, host=probe_host())
    if calibration is not None:
        machine = apply(machine, calibration)
    if ram:
        size = parse_bytes(ram)
        machine = Machine(gpus=machine.gpus, host=replace(machine.host, total_bytes=size, free_bytes=size,
                                                          source=machine.host.source + ", --ram"))
    return machine
