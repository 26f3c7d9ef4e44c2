"""cpu_info: what benchmarks print and kernels dispatch on, read from /proc/cpuinfo, torch-free."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from localrun.cpu_info import FLAGS_THAT_MATTER, cpu_flags, cpu_info

needs_proc_cpuinfo = pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="no /proc/cpuinfo (not Linux)")


@needs_proc_cpuinfo
def test_flags_are_those_of_proc_cpuinfo():
    first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    flags_line = next(line for line in first.splitlines() if line.startswith("flags"))
    expected = set(flags_line.split(":", 1)[1].split())
    assert cpu_flags() == expected
    info = cpu_info(with_torch=False)
    assert info["flags"] == {flag: flag in expected for flag in FLAGS_THAT_MATTER}
    assert info["model"] and info["model"] in first


def test_torch_capability_and_overrides_are_reported(monkeypatch):
    import torch
    monkeypatch.setenv("LOCALRUN_ISA", "avx2")
    info = cpu_info()
    assert info["torch_capability"] == torch.backends.cpu.get_cpu_capability()
    assert info["localrun_isa"] == "avx2"
    assert info["aten_cpu_capability"] == os.environ.get("ATEN_CPU_CAPABILITY")
    assert cpu_info(with_torch=False)["torch_capability"] is None


def test_imports_no_torch():
    code = ("import sys, json; from localrun.cpu_info import cpu_info; "
            "json.dumps(cpu_info(with_torch=False)); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parent.parent)


def test_cpu_time_shares_are_computed_from_stat_deltas():
    """Shares of the ticks between two readings, by hand: 60 busy (user, nice, system, irq,
    softirq), 20 idle (idle, iowait), 20 steal, of 100."""
    from localrun.cpu_info import STAT_FIELDS, cpu_time_shares
    before = dict.fromkeys(STAT_FIELDS, 1000)
    after = {**before, "user": 1030, "nice": 1005, "system": 1015, "irq": 1004, "softirq": 1006,
             "idle": 1015, "iowait": 1005, "steal": 1020}
    assert cpu_time_shares(before, after) == {"busy": 0.6, "idle": 0.2, "steal": 0.2}
    assert cpu_time_shares(before, before) is None           # no ticks between: no shares
    assert cpu_time_shares(None, after) is None


@needs_proc_cpuinfo
def test_cpu_info_reports_the_time_shares_since_start():
    shares = cpu_info(with_torch=False)["time_shares"]
    assert shares is not None and set(shares) == {"busy", "idle", "steal"}
    assert abs(sum(shares.values()) - 1) <= 0.002 and all(0 <= v <= 1 for v in shares.values())


def test_steal_marks_a_run_over_the_limit():
    """At the limit a run is fine, past it not; without shares, unknown."""
    from localrun.cpu_info import STEAL_LIMIT, steal_ok
    assert steal_ok({"busy": 0.9, "idle": 0.1 - STEAL_LIMIT, "steal": STEAL_LIMIT}) is True
    assert steal_ok({"busy": 0.6, "idle": 0.2, "steal": 0.2}) is False
    assert steal_ok(None) is None


@needs_proc_cpuinfo
def test_cpu_info_says_whether_steal_stayed_under_the_limit():
    from localrun.cpu_info import steal_ok
    info = cpu_info(with_torch=False)
    assert info["steal_ok"] == steal_ok(info["time_shares"]) and info["steal_ok"] is not None
