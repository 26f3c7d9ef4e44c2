"""Calibration bookkeeping: other processes' CPU use (measured, else the load average) decides
whether a calibration is trusted, and the cache is keyed by CPU model and flags, GPUs and driver,
and localrun's version."""
import json
import os
from dataclasses import asdict, replace

import pytest

from layerplan import calibrate, quiet
from layerplan.machine_spec import build_machine


@pytest.mark.parametrize("before, after, threads, suspect", [
    (0.1, 2.3, 2, False),   # quiet, then our own 2 threads
    (0.6, 2.0, 2, True),    # more than half a core busy before we began
    (0.2, 3.0, 2, True),    # another task joined while we measured
    (0.5, 2.5, 2, False),   # exactly at the limits
])
def test_load_decides_suspect(before, after, threads, suspect):
    assert calibrate.is_suspect(before, after, threads) is suspect


def _calibration(machine, **changes):
    base = calibrate.Calibration(fingerprint=calibrate.fingerprint(machine), host_bandwidth=12e9, host_flops=3e11,
                                 host_matmul_overhead_s=4e-6, load_before=0.1, load_after=2.1)
    return replace(base, **changes)


def test_a_suspect_calibration_is_neither_saved_nor_loaded(tmp_path):
    machine = build_machine(probe_gpus=False)
    suspect = _calibration(machine, load_before=1.4, suspect=True)
    assert calibrate.save(suspect, tmp_path) is None and not (tmp_path / calibrate.CALIBRATION_FILE).exists()
    (tmp_path / calibrate.CALIBRATION_FILE).write_text(json.dumps(asdict(suspect)))   # an older file, say
    assert calibrate.load(machine, tmp_path) is None
    quiet = _calibration(machine)
    assert calibrate.save(quiet, tmp_path) is not None and calibrate.load(machine, tmp_path) == quiet
    assert "suspect" in calibrate.apply(machine, suspect).host.source
    assert "1.4 before" in suspect.load_note


def test_the_key_holds_cpu_flags_driver_and_version(tmp_path, monkeypatch):
    machine = build_machine(probe_gpus=False)
    key = calibrate.fingerprint(machine)
    assert f"flags {calibrate._cpu_flags()}" in key and f"localrun {calibrate._localrun_version()}" in key
    calibrate.save(_calibration(machine), tmp_path)
    monkeypatch.setattr(calibrate, "_cpu_flags", lambda: "avx2-only")        # another CPU kind
    assert calibrate.load(machine, tmp_path) is None
    monkeypatch.undo()
    monkeypatch.setattr(calibrate, "_localrun_version", lambda: "9.9.9")     # another localrun
    assert calibrate.load(machine, tmp_path) is None
    monkeypatch.undo()
    assert calibrate.load(machine, tmp_path) is not None


# /proc/stat's first line: user nice system idle iowait irq softirq steal guest guest_nice (ticks)
STAT = "cpu  1000 20 300 9000 50 7 3 70 0 0\ncpu0 500 10 150 4500 25 3 1 35 0 0\n"


def test_busy_time_counts_every_busy_field_and_steal_but_not_idle_or_iowait():
    assert quiet.machine_busy_seconds(STAT) == pytest.approx((1000 + 20 + 300 + 7 + 3 + 70) / os.sysconf("SC_CLK_TCK"))
    assert quiet.machine_busy_seconds("not a stat file") is None


def test_other_processes_cores_are_the_machine_busy_time_less_ours():
    # 2 s of wall time: the machine was busy 3.0 CPU-seconds, 2.5 of them ours: others kept 0.25 cores busy
    assert quiet.other_cores(busy_s=3.0, own_s=2.5, wall_s=2.0) == pytest.approx(0.25)
    assert quiet.other_cores(busy_s=1.0, own_s=1.02, wall_s=1.0) == 0.0     # counters tick apart: never below 0


def test_the_meter_takes_our_own_cpu_time_out_of_the_machine_busy_time():
    now = {"wall, busy, ours": (100.0, 50.0, 10.0)}
    meter = quiet.OtherCPU(tuple(lambda k=k: now["wall, busy, ours"][k] for k in range(3)))
    # 2 s later the machine was busy 3.1 CPU-seconds more, 2.6 of them ours (two busy threads)
    now["wall, busy, ours"] = (102.0, 53.1, 12.6)
    assert meter.cores() == pytest.approx(0.25)
    assert quiet.OtherCPU((lambda: 1.0, lambda: None, lambda: 0.0)).cores() is None   # no /proc/stat


def test_waiting_for_quiet_stops_at_the_first_quiet_sample_or_the_deadline():
    samples = iter([1.2, 0.8, 0.1, 0.0])
    assert quiet.wait_until_quiet(60, sample=lambda s: next(samples)) == 0.1
    assert quiet.wait_until_quiet(0, sample=lambda s: 1.5) == 1.5      # busy, but the time is up
    assert quiet.wait_until_quiet(60, sample=lambda s: None) is None    # not measurable: no wait


@pytest.mark.parametrize("other_cpu, suspect", [(0.05, False), (0.25, False), (0.6, True)])
def test_measured_other_work_decides_suspect_over_the_load_average(other_cpu, suspect):
    # a high load average (our previous run still in it) does not matter once other work is measured
    assert calibrate.is_suspect(1.8, 3.5, 2, other_cpu) is suspect


def test_each_model_keeps_its_own_engine_calibration(tmp_path):
    """Two models' engine calibrations on one machine: a plan for either reads its own model's
    figures; a model never timed reads the machine's latest; a file changed since (another size)
    is another model; and the source says which model timed the figures."""
    machine = build_machine(probe_gpus=False)
    a, b, c = (tmp_path / name for name in ("a.gguf", "b.gguf", "c.gguf"))
    for path, size in ((a, 10), (b, 20), (c, 30)):
        path.write_bytes(b"\0" * size)
    cal_a = _calibration(machine, host_kv_bandwidth=7.9e9, engine_key=calibrate.engine_key(a))
    cal_b = _calibration(machine, host_kv_bandwidth=4.1e9, engine_key=calibrate.engine_key(b))
    cache = tmp_path / "cache"
    calibrate.save(cal_a, cache)
    calibrate.save(cal_b, cache)
    assert calibrate.load(machine, cache, model=a) == cal_a
    assert calibrate.load(machine, cache, model=b) == cal_b
    assert calibrate.load(machine, cache, model=c) == cal_b == calibrate.load(machine, cache)   # the latest
    assert calibrate.load(machine, cache, model=tmp_path / "gone.gguf") == cal_b
    a.write_bytes(b"\0" * 11)                                  # re-quantized, say: not the file timed
    assert calibrate.load(machine, cache, model=a) == cal_b
    assert calibrate.engine_key(b) == "b.gguf|20"
    assert calibrate.apply(machine, replace(cal_b, engine_model="b: ...")).host.source.endswith(
        " with localrun's engine on b.gguf")
    # a suspect one replaces neither
    calibrate.save(replace(cal_b, suspect=True, host_kv_bandwidth=1.0), cache)
    assert calibrate.load(machine, cache, model=b) == cal_b


def test_an_engine_calibration_of_other_kernels_is_passed_over(tmp_path):
    """An engine calibration describes the kernels it timed: a plan of a localrun whose kernel
    build differs reads neither it nor, through the machine's latest, the same figures; layerplan
    alone (no build to compare) and a plan of the same build read it; a host-only calibration
    (no engine figures) is read by any build."""
    machine = build_machine(probe_gpus=False)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"\0" * 10)
    cache = tmp_path / "cache"
    timed = _calibration(machine, host_kv_bandwidth=7.9e9, engine_key=calibrate.engine_key(model), engine_build="aaaa")
    calibrate.save(timed, cache)
    assert calibrate.load(machine, cache, model=model, engine_build="aaaa") == timed
    assert calibrate.load(machine, cache, model=model) == timed
    assert calibrate.load(machine, cache, model=model, engine_build="bbbb") is None
    assert calibrate.load(machine, cache, engine_build="bbbb") is None
    host_only = _calibration(machine)
    calibrate.save(host_only, cache)
    assert calibrate.load(machine, cache, model=tmp_path / "other.gguf", engine_build="bbbb") == host_only
    old = {k: v for k, v in asdict(timed).items() if k != "engine_build"}      # saved before the field existed
    (cache / "calibration.json").write_text(json.dumps(old))
    assert calibrate.load(machine, cache, engine_build="aaaa") is None


def test_the_engine_build_follows_the_kernel_sources_and_switches(tmp_path, monkeypatch):
    """localrun's engine_build (torch-free) changes with any kernel source's bytes or name and
    with the switches that pick a kernel, and with nothing else."""
    from localrun.engine_build import CSRC, engine_build
    for name in ("LOCALRUN_ISA", "LOCALRUN_NO_KERNELS", "LOCALRUN_KERNEL_LIBRARY"):
        monkeypatch.delenv(name, raising=False)
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "a.cpp").write_text("int a;")
    first = engine_build(src)
    assert engine_build(src) == first and len(first) == 16
    (src / "a.cpp").write_text("int b;")
    assert engine_build(src) != first
    (src / "a.cpp").write_text("int a;")
    assert engine_build(src) == first
    (src / "a.cpp").rename(src / "b.cpp")
    assert engine_build(src) != first
    plain = engine_build(CSRC)
    monkeypatch.setenv("LOCALRUN_ISA", "avx2")
    assert engine_build(CSRC) != plain


def test_plan_says_when_it_passes_over_another_builds_engine_calibration(tiny_gguf, tmp_path, monkeypatch):
    """`localrun plan` with an engine calibration of this model taken by other kernels: one line
    on stderr saying so and how to retake it, and the plan's figures are not that calibration's;
    with the running build's, no such line and the figures are the engine's."""
    from typer.testing import CliRunner

    from localrun.cli.main import app
    from localrun.engine_build import engine_build
    monkeypatch.setenv("LOCALRUN_HOME", str(tmp_path / "home"))
    path = tiny_gguf("Q8_0")
    machine = build_machine(probe_gpus=False)
    timed = _calibration(machine, host_kv_bandwidth=7.9e9, engine_key=calibrate.engine_key(path),
                         engine_model="tiny: ...", engine_build="0" * 16)
    calibrate.save(timed)
    said = "taken with another build of localrun's kernels"
    result = CliRunner().invoke(app, ["plan", str(path), "--json"], catch_exceptions=False)
    assert result.exit_code == 0 and said in result.stderr
    assert "localrun's engine" not in json.loads(result.stdout.strip().splitlines()[-1])["devices"][-1]["source"]
    calibrate.save(replace(timed, engine_build=engine_build()))
    result = CliRunner().invoke(app, ["plan", str(path), "--json"], catch_exceptions=False)
    assert result.exit_code == 0 and said not in result.stderr
    assert "localrun's engine" in json.loads(result.stdout.strip().splitlines()[-1])["devices"][-1]["source"]
