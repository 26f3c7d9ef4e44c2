"""CI's second pass (the numerics tests with the AVX2 kernels forced) tests what it claims to."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from conftest import NUMERICS_TESTS
from localrun.cpu_info import has_flag

TESTS = Path(__file__).resolve().parent


def test_numerics_list_names_existing_tests():
    """A renamed test must not silently drop out of the AVX2 pass."""
    for entry in NUMERICS_TESTS:
        file_name, _, test_name = entry.partition("::")
        assert (TESTS / file_name).exists(), entry
        if test_name:
            assert re.search(rf"^def {test_name}\(", (TESTS / file_name).read_text(), re.M), entry


def test_torch_runs_the_kernels_ci_forces():
    """torch honours ATEN_CPU_CAPABILITY (CI's AVX2 pass sets it); unset, it picks the CPU's best."""
    import torch
    capability = torch.backends.cpu.get_cpu_capability()
    forced = os.environ.get("ATEN_CPU_CAPABILITY")
    if forced:
        assert capability == forced.upper()
    elif all(has_flag(f) for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq")):
        assert capability == "AVX512"
    elif has_flag("avx2") and has_flag("fma"):
        assert capability == "AVX2"


def test_kernels_run_on_this_cpu_without_silent_fallback():
    """On an x86-64 CPU with AVX2 the compiled kernels load and pick the widest instruction set
    the CPU has (or the one LOCALRUN_ISA forces), and a quantized model uses them: prompt rows
    take the dequantized-GEMM path on every CPU kind, never torch's int4 kernel by accident."""
    import os
    import platform

    from localrun import kernels
    from localrun.cpu_info import cpu_info
    if platform.machine() not in ("x86_64", "AMD64") or os.environ.get("LOCALRUN_NO_KERNELS") == "1":
        pytest.skip("the kernels have SIMD paths for x86-64; LOCALRUN_NO_KERNELS=1 turns them off on purpose")
    flags = cpu_info()["flags"]
    if not flags.get("avx2"):
        pytest.skip("this CPU has no AVX2")
    assert kernels.available(), "the compiled kernels did not load on this CPU"
    forced = os.environ.get("LOCALRUN_ISA")
    expected = forced or ("avx512" if flags.get("avx512f") and flags.get("avx512_vnni")
                          else "avxvnni" if flags.get("avx_vnni") else "avx2")
    assert kernels.isa() == expected, (kernels.isa(), flags)
