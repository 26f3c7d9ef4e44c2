"""Calibration bookkeeping: the load average decides whether a calibration is trusted, and the
cache is keyed by CPU model and flags, GPUs and driver, and localrun's version."""
import json
from dataclasses import asdict, replace

import pytest

from layerplan import calibrate
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
