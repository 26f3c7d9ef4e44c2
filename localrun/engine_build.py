"""Which build of localrun's compute path an engine calibration timed, without importing torch
(`localrun plan` compares it before it plans).

A calibration of the engine (localrun/calibrate_engine.py) describes the kernels it ran: after a
change to them (a faster one-sequence decode, say) its figures predict the old library. The
package's version names a release, not an editable tree's kernels, so the calibration also
records this digest of the kernels' sources and of the switches that pick among them
(LOCALRUN_ISA, LOCALRUN_NO_KERNELS, LOCALRUN_KERNEL_LIBRARY), and layerplan's `calibrate.load`
passes over one whose digest differs from the running build's."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "kernels" / "csrc"
SWITCHES = ("LOCALRUN_ISA", "LOCALRUN_NO_KERNELS", "LOCALRUN_KERNEL_LIBRARY")


def engine_build(csrc: Path = CSRC) -> str:
    """16 hex digits: the kernel sources (names and bytes) and the switches as set now."""
    h = hashlib.sha256()
    for path in sorted(csrc.iterdir()) if csrc.is_dir() else ():
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    for name in SWITCHES:
        h.update(f"{name}={os.environ.get(name, '')}\0".encode())
    return h.hexdigest()[:16]
