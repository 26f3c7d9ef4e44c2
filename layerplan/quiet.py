"""Other work on the CPU, measured while we time something, instead of guessed from the load average.

The 1-minute load average lags by a minute and counts our own threads: right after a benchmark's
worker process (or a calibration's own engine) stops, it still says "busy", and while we measure it
cannot tell our threads from someone else's. What a timing needs to know is how many cores *other*
processes kept busy while it ran: the machine's busy CPU time over that interval (from /proc/stat,
steal included, since a hypervisor running other guests takes cycles from us too) less this
process's own CPU time, divided by the wall time. `OtherCPU` measures that; `wait_until_quiet`
waits (a bounded time) until other work has stopped before a timing starts.

Linux only (/proc/stat); elsewhere the figures are None and callers fall back to the load average.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

QUIET_CORES = 0.25        # other processes' average CPU use (cores) below which a timing is quiet
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)   # /proc/stat cpu: user nice system [idle iowait] irq softirq steal


def machine_busy_seconds(stat: str | None = None) -> float | None:
    """CPU seconds all cores have spent busy since boot (None without /proc/stat). `stat` is the
    file's text (tests pass their own)."""
    try:
        text = stat if stat is not None else Path("/proc/stat").read_text()
        fields = text.split("\n", 1)[0].split()
        assert fields[0] == "cpu"
        ticks = [int(v) for v in fields[1:]]
        return sum(ticks[i] for i in _BUSY_FIELDS if i < len(ticks)) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AssertionError, IndexError):
        return None


def own_cpu_seconds() -> float:
    """CPU seconds this process has used (all its threads)."""
    t = os.times()
    return t.user + t.system


class OtherCPU:
    """Cores other processes kept busy between start() (or creation) and cores(), on average.
    The three clocks are the wall, the machine's busy time and ours (tests pass their own)."""

    def __init__(self, clocks=None):
        self._clocks = clocks or (time.perf_counter, machine_busy_seconds, own_cpu_seconds)
        self.start()

    def start(self) -> None:
        self._start = [clock() for clock in self._clocks]

    def cores(self) -> float | None:
        (wall0, busy0, own0), (wall, busy, own) = self._start, [clock() for clock in self._clocks]
        if busy is None or busy0 is None or wall <= wall0:
            return None
        return other_cores(busy - busy0, own - own0, wall - wall0)


def other_cores(busy_s: float, own_s: float, wall_s: float) -> float:
    """Cores other work kept busy: the machine's busy seconds less ours, over the wall time
    (never below 0: the two counters tick at different moments)."""
    return max(0.0, (busy_s - own_s) / wall_s)


def sample_other_cpu(seconds: float = 0.5) -> float | None:
    """Cores other processes use now, over `seconds` of sleeping."""
    meter = OtherCPU()
    time.sleep(seconds)
    return meter.cores()


def wait_until_quiet(timeout_s: float = 60.0, threshold: float = QUIET_CORES, sample_s: float = 0.5,
                     sample=sample_other_cpu) -> float | None:
    """Wait until other processes use less than `threshold` cores (sampled every `sample_s`),
    for at most `timeout_s`. Returns the last sample (None where it cannot be measured)."""
    deadline = time.monotonic() + timeout_s
    while True:
        cores = sample(sample_s)
        if cores is None or cores < threshold or time.monotonic() >= deadline:
            return cores
