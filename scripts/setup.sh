#!/usr/bin/env bash
# Set-up for localrun: create or reuse .venv at the repository root, install torch (a CPU
# build when no NVIDIA GPU is present, CUDA otherwise), llama-cpp-python built for this CPU,
# the project (editable) and, unless told otherwise, the default model.
# Safe to run again: every step is skipped when already done.
#   LOCALRUN_SKIP_MODEL=1  do not fetch the default model
#   LOCALRUN_CUDA=0|1      force the CPU or the CUDA build (default: detect nvidia-smi)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
PY="${PYTHON:-python3}"
VENV="$ROOT/.venv"
PIP="$VENV/bin/python -m pip --disable-pip-version-check"
LLAMA_CPP_VERSION="0.3.36"
TORCH_CPU_VERSION="2.13.0"
say() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV"
    "$PY" -m venv "$VENV"
fi

if [ -z "${LOCALRUN_CUDA:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then LOCALRUN_CUDA=1; else LOCALRUN_CUDA=0; fi
fi

# torch: the CPU build on machines without an NVIDIA GPU (small, and on disk on our machines);
# the default (CUDA) build otherwise.
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    if [ "$LOCALRUN_CUDA" = 1 ]; then
        say "installing torch (CUDA build)"
        $PIP install -q torch
    else
        say "installing torch $TORCH_CPU_VERSION (CPU build)"
        $PIP install -q "torch==$TORCH_CPU_VERSION" || $PIP install -q torch
    fi
fi

# llama-cpp-python: the peer and reference. ggml's native build uses AMX instructions that
# some CPUs advertise but cannot run (SIGILL at the first prompt), so build a portable set
# of x86 features; with CUDA add the CUDA backend. pip's wheel cache ignores CMAKE_ARGS, so
# build our own wheel into a folder keyed by the flags, never from pip's cache.
if [ "$(uname -m)" = "x86_64" ]; then
    CPU_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
    if grep -q avx512f /proc/cpuinfo 2>/dev/null; then
        CPU_FLAGS="$CPU_FLAGS -DGGML_AVX512=ON"
        grep -q avx512_vnni /proc/cpuinfo && CPU_FLAGS="$CPU_FLAGS -DGGML_AVX512_VNNI=ON"
        grep -q avx512_bf16 /proc/cpuinfo && CPU_FLAGS="$CPU_FLAGS -DGGML_AVX512_BF16=ON"
    fi
    CPU_FLAGS="$CPU_FLAGS -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
else
    CPU_FLAGS="-DGGML_NATIVE=ON"
fi
[ "$LOCALRUN_CUDA" = 1 ] && CPU_FLAGS="$CPU_FLAGS -DGGML_CUDA=ON"
FLAGS_KEY="$(printf '%s %s' "$LLAMA_CPP_VERSION" "$CPU_FLAGS" | sha256sum | cut -c1-12)"
STAMP="$VENV/.llama-cpp-$FLAGS_KEY"
if [ ! -f "$STAMP" ]; then
    WHEELS="${LOCALRUN_HOME:-$HOME/.cache/localrun}/wheels/llama-cpp-$FLAGS_KEY"
    if ! ls "$WHEELS"/llama_cpp_python-*.whl >/dev/null 2>&1; then
        say "building llama-cpp-python $LLAMA_CPP_VERSION (about 7 minutes on 2 cores) with: $CPU_FLAGS"
        mkdir -p "$WHEELS.tmp"
        CMAKE_ARGS="$CPU_FLAGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
            $PIP wheel -q --no-deps --no-cache-dir -w "$WHEELS.tmp" "llama-cpp-python==$LLAMA_CPP_VERSION"
        rm -rf "$WHEELS" && mv "$WHEELS.tmp" "$WHEELS"
    fi
    say "installing llama-cpp-python from $WHEELS"
    $PIP install -q --force-reinstall --no-deps "$WHEELS"/llama_cpp_python-*.whl
    rm -f "$VENV"/.llama-cpp-*
fi

# the project itself, editable, with the test tools
if ! "$VENV/bin/python" -c "import localrun, pytest, hypothesis, llguidance, jsonschema" >/dev/null 2>&1 || [ pyproject.toml -nt "$VENV/.project-installed" ]; then
    say "installing localrun (editable)"
    $PIP install -q -e ".[dev]"
    touch "$VENV/.project-installed"
fi

# localrun's compiled kernels (quantized matmuls on the GGUF blocks), built once per source,
# torch and compiler under $LOCALRUN_HOME/kernels/; a compiler error stops set-up with its message
if [ "${LOCALRUN_NO_KERNELS:-0}" != 1 ]; then
    if ! "$VENV/bin/python" -m localrun.kernels.build >/dev/null; then
        say "set LOCALRUN_NO_KERNELS=1 to run without the compiled kernels (slower)"
        exit 1
    fi
fi

if [ "${LOCALRUN_SKIP_MODEL:-0}" != 1 ]; then
    "$VENV/bin/localrun" pull smollm2-135m >/dev/null
fi

# prove llama.cpp runs on this CPU: a real evaluation, not just an import
if [ ! -f "$STAMP" ]; then
    if [ "${LOCALRUN_SKIP_MODEL:-0}" != 1 ]; then
        say "checking that llama.cpp evaluates a token on this CPU"
        if ! "$VENV/bin/python" scripts/check_llama_cpp.py; then
            say "llama-cpp-python failed its evaluation check (see above); remove $WHEELS and run again"
            exit 1
        fi
    fi
    touch "$STAMP"
fi
say "ready: $VENV/bin/localrun"
