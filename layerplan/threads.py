"""How many threads the engine should run: physical cores less the ones other work keeps busy.

Decode on a CPU is memory-bound, and a thread that waits for a core another process holds
stalls every other thread at the next barrier: on a small machine, oversubscription collapses
both llama.cpp and localrun. So the advice is one thread per physical core (hyperthreads add
nothing to a memory-bound matvec), less the cores the 1-minute load average says are taken,
and never below one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ThreadAdvice:
    recommended: int
    physical_cores: int
    logical_cores: int
    load_1m: float       # runnable tasks: the 1-minute average, or the last instant's CPU use if lower (0 where the OS has none)
    busy_cores: int      # cores taken by other work: the load, rounded half up

    @property
    def reason(self) -> str:
        cores = f"{self.physical_cores} physical core{'s' if self.physical_cores != 1 else ''}"
        if not self.busy_cores:
            return f"{cores}, load {self.load_1m:.1f}: {self.recommended} thread{'s' if self.recommended != 1 else ''}"
        return (f"{cores}, {self.busy_cores} busy with other work (load {self.load_1m:.1f}): "
                f"{self.recommended} thread{'s' if self.recommended != 1 else ''}, so the engine does not fight "
                "for cores")


def recommend_threads(physical_cores: int, logical_cores: int, load_1m: float) -> ThreadAdvice:
    """The advice for a machine with these cores under this load (pure: tests pass the figures)."""
    physical = max(1, physical_cores)
    busy = max(0, math.floor(load_1m + 0.5)) if math.isfinite(load_1m) else 0
    return ThreadAdvice(max(1, physical - busy), physical, max(physical, logical_cores), max(0.0, load_1m), busy)


def advise_threads(sample_s: float = 0.2) -> ThreadAdvice:
    """The advice for this machine, now: psutil's core counts, and the lower of the 1-minute
    load average and the load of the last `sample_s` seconds (CPU use times logical CPUs). The
    average alone lags by a minute: right after localrun's own benchmark or server stopped it
    still counts them, and the next start would get 1 thread on an idle machine."""
    import psutil

    logical = psutil.cpu_count(logical=True) or 1
    physical = psutil.cpu_count(logical=False) or logical
    try:
        load = psutil.getloadavg()[0]
    except (AttributeError, OSError):
        load = 0.0
    if load > 0 and sample_s > 0:
        load = min(load, psutil.cpu_percent(interval=sample_s) / 100 * logical)
    return recommend_threads(physical, logical, load)
