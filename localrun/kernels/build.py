"""Compile localrun's kernels (csrc/) into one shared library that torch loads as custom ops.

`python -m localrun.kernels.build` is run by set-up; `library_path()` says where the library
for this source, torch and compiler lives (localrun/kernels/_build/<key>/), and `build()`
makes it if it is missing. Each instruction set's file is compiled with its own flags; the
library picks one at run time (csrc/ops.cpp), so one build serves every x86-64 CPU kind.
Plain g++ against torch's headers: no ninja, no setuptools extension.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from layerplan.home import localrun_home

CSRC = Path(__file__).resolve().parent / "csrc"
COMMON_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-fopenmp", "-ffp-contract=off", "-fvisibility=hidden",
                "-Wno-unused-parameter", "-Wno-ignored-attributes"]
X86 = os.uname().machine in ("x86_64", "AMD64")
SOURCES = {   # file -> extra flags
    "ops.cpp": [],
    "small_ops.cpp": [],
    "paged_attention.cpp": [],
    "decode_block.cpp": [],
    "topk.cpp": [],
    "prompt_attention.cpp": [],
    "qmatmul_avx2.cpp": ["-mavx2", "-mfma", "-mf16c"] if X86 else None,
    "qmatmul_avxvnni.cpp": ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"] if X86 else None,
    # the AVX-VNNI kernels through vpdpbusd's EVEX form, kept to the 16 registers a VEX build has
    "qmatmul_avxvnni_evex.cpp": ["-mavx2", "-mfma", "-mf16c", "-mavx512vl", "-mavx512vnni",
                                 *(f"-ffixed-xmm{i}" for i in range(16, 32))] if X86 else None,
    "qmatmul_avx512.cpp": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"]
    if X86 else None,
}


class BuildError(RuntimeError):
    pass


def _compiler() -> str:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or "g++"


def _key(csrc: Path = CSRC) -> str:
    import torch
    h = hashlib.sha256()
    for path in sorted(csrc.iterdir()):
        h.update(path.name.encode() + path.read_bytes())
    h.update(f"{torch.__version__} {_compiler()} {sys.version_info[:2]} {COMMON_FLAGS} {SOURCES}".encode())
    return h.hexdigest()[:16]


def library_path(csrc: Path = CSRC) -> Path:
    """Beside the sources where that folder is writable (an editable install), else under
    $LOCALRUN_HOME/kernels/; keyed by sources, torch and compiler. csrc: another version of the
    sources (benchmarks/kernel_ab.py builds two side by side)."""
    local = CSRC.parent / "_build"
    if os.access(CSRC.parent, os.W_OK):
        return local / _key(csrc) / "liblocalrun_kernels.so"
    return localrun_home() / "kernels" / _key(csrc) / "liblocalrun_kernels.so"


def build(quiet: bool = False, csrc: Path = CSRC) -> Path:
    """Compile the library if it is not there yet; BuildError with the compiler's message if not."""
    target = library_path(csrc)
    if target.exists():
        return target
    if not X86:
        raise BuildError("the kernels have SIMD paths for x86-64 only so far")
    import torch
    from torch.utils import cpp_extension
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    torch_lib = Path(torch.__file__).parent / "lib"
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        sources = dict(SOURCES)
        if not _accepts("-mavxvnni"):     # GCC before 11: AVX-VNNI CPUs run the AVX2 kernels
            print("[kernels] this compiler has no -mavxvnni: AVX-VNNI CPUs will run the AVX2 kernels", file=sys.stderr)
            sources["qmatmul_avxvnni.cpp"] = [*SOURCES["qmatmul_avx2.cpp"], "-DLOCALRUN_AVXVNNI_AS_AVX2"]

        def compile_one(name: str, flags: list[str]) -> str:
            obj = Path(tmp) / (name + ".o")
            if not quiet:
                print(f"[kernels] compiling {name}", file=sys.stderr)
            _run([_compiler(), *COMMON_FLAGS, *flags, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes,
                  "-c", str(csrc / name), "-o", str(obj)])
            return str(obj)

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:     # one compiler per core
            objects = list(pool.map(lambda item: compile_one(*item), sources.items()))
        out = Path(tmp) / target.name
        _run([_compiler(), "-shared", "-fopenmp", *objects, f"-L{torch_lib}", "-lc10", "-ltorch_cpu",
              f"-Wl,-rpath,{torch_lib}", "-o", str(out)])
        os.replace(out, target)
    return target


def _accepts(flag: str) -> bool:
    """Whether the compiler takes this flag (an empty translation unit compiled with it)."""
    try:
        return subprocess.run([_compiler(), flag, "-x", "c++", "-c", "-o", os.devnull, "-"], input="",
                              capture_output=True, text=True).returncode == 0
    except FileNotFoundError:
        return False


def _run(cmd: list[str]) -> None:
    try:
        result = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        raise BuildError(f"no C++ compiler found ({cmd[0]}); install g++ or set CXX") from None
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if "error" in line]
        raise BuildError(errors[0] if errors else result.stderr.strip()[-500:])


def main() -> int:
    try:
        path = build()
    except BuildError as e:
        print(f"localrun: the kernels did not compile: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
