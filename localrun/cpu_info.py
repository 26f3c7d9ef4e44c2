"""The host CPU in one dict: model name, the instruction-set flags our kernels care about, and
the kernel level torch picked. Benchmarks print it in their JSON line; tests and kernels read
the flags from here. Imports no torch unless asked for torch's capability.

    >>> cpu_info()["flags"]["avx512_vnni"]
    True
"""
from __future__ import annotations

import importlib.util
import os
import platform
import threading
from functools import lru_cache
from pathlib import Path

# The flags that decide which kernels run, named as /proc/cpuinfo names them.
FLAGS_THAT_MATTER = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16",
                     "amx_tile", "amx_int8", "amx_bf16")


@lru_cache(maxsize=1)
def _proc_cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, all flags) of the first processor in /proc/cpuinfo; ("", {}) off Linux."""
    model, flags = "", frozenset()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
        if model and flags:
            break
    return model, flags


def cpu_flags() -> frozenset[str]:
    """Every flag the kernel reports for this CPU (empty where /proc/cpuinfo is absent)."""
    return _proc_cpuinfo()[1]


def has_flag(name: str) -> bool:
    return name in cpu_flags()


def torch_capability() -> str | None:
    """torch's CPU kernel level ("AVX512", "AVX2", "DEFAULT", ...), which honours
    ATEN_CPU_CAPABILITY; None when torch is not installed."""
    if importlib.util.find_spec("torch") is None:
        return None
    import torch
    return torch.backends.cpu.get_cpu_capability()


def cpu_info(with_torch: bool = True) -> dict:
    """{"model", "machine", "flags": {flag: bool}, "torch_capability", "aten_cpu_capability",
    "localrun_isa", "time_shares", "steal_ok"}: the environment overrides in force (None when
    unset), how all CPUs' time went since this module was imported (a benchmark's start: busy,
    idle, steal; cpu_time_shares), and whether the steal stayed within STEAL_LIMIT (None where
    it cannot be read): a benchmark whose JSON says false measured the host's neighbours as
    much as the code, and its figures are not to be compared with a quiet run's."""
    model, _ = _proc_cpuinfo()
    shares = cpu_time_shares(_TIMES_AT_IMPORT)
    return {
        "model": model or platform.processor() or platform.machine(),
        "machine": platform.machine(),
        "flags": {flag: has_flag(flag) for flag in FLAGS_THAT_MATTER},
        "torch_capability": torch_capability() if with_torch else None,
        "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY"),
        "localrun_isa": os.environ.get("LOCALRUN_ISA"),
        "time_shares": shares,
        "steal_ok": steal_ok(shares),
    }


# The share of the CPUs' time the hypervisor may give other guests during a benchmark before
# its figures are marked (cpu_info's "steal_ok"). On a 2-core VM, 15-44% steal over whole
# minutes was seen, and it alone doubled engine step times. Under the limit a run is not
# thereby steady (docs/kernels.md: ±15% between runs at 1% steal on the same host); over it,
# it is not worth comparing at all.
STEAL_LIMIT = 0.05


def steal_ok(shares: dict | None) -> bool | None:
    """Whether time shares (cpu_time_shares) show steal within STEAL_LIMIT; None without them."""
    return None if shares is None else shares["steal"] <= STEAL_LIMIT


# /proc/stat's aggregate CPU columns, in order (proc(5)), in clock ticks since boot
STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_times() -> dict[str, int] | None:
    """All CPUs' time so far by kind ({field: ticks}, STAT_FIELDS); None off Linux."""
    try:
        with open("/proc/stat") as f:
            first = f.readline().split()
    except OSError:
        return None
    if not first or first[0] != "cpu":
        return None
    return dict(zip(STAT_FIELDS, map(int, first[1:1 + len(STAT_FIELDS)])))


def cpu_time_shares(before: dict[str, int] | None, after: dict[str, int] | None = None) -> dict | None:
    """How all CPUs' time between two cpu_times() readings (after: now) was spent, as shares:
    busy (this guest's work: ours and anything else running), idle, and steal (time the
    hypervisor gave other guests while this one wanted to run). A figure measured under steal
    is slower than the code; benchmarks print these beside their figures. None off Linux."""
    after = after if after is not None else cpu_times()
    if before is None or after is None:
        return None
    d = {k: after[k] - before[k] for k in STAT_FIELDS}
    total = sum(d.values())
    if total <= 0:
        return None
    busy = d["user"] + d["nice"] + d["system"] + d["irq"] + d["softirq"]
    return {"busy": round(busy / total, 3), "idle": round((d["idle"] + d["iowait"]) / total, 3),
            "steal": round(d["steal"] / total, 3)}


_TIMES_AT_IMPORT = cpu_times()


if __name__ == "__main__":
    import json
    print(json.dumps(cpu_info()))


def lower_thread_priority(nice: int = 19) -> None:
    """Run the calling thread at a lower CPU priority (19: the lowest) where the OS allows it per
    thread (Linux: a thread is a task with its own nice value); elsewhere, do nothing."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):
        pass
