"""CI's second pass (the numerics tests with the AVX2 kernels forced) tests what it claims to."""
from __future__ import annotations

import os
import re
from pathlib import Path

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
