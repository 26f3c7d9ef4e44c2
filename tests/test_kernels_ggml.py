"""The integer kernel against a second oracle: ggml's own CPU dot products (`vec_dot` of
llama-cpp-python's libggml-cpu, reached through `ggml_get_type_traits_cpu`), on the same file
blocks and the same float activations, each side quantizing the activations to 8 bits its own
way (ggml: q8_0 blocks with a float16 scale for Q4_0/Q5_0/Q8_0, q8_1 for Q4_1/Q5_1, q8_K blocks
of 256 for the K-quants; localrun: blocks of 32 with a float32 scale).
- Activations that every one of those quantizations holds exactly (codes times 2^-6, a code of
  +-127 in every block of 32): both compute the same exact sums, so they agree to float32
  rounding. Measured (2026-12-05, Zen 4, AVX-512 and forced AVX2, both layouts): at most
  2.6e-7 of the products' size, for every type; one bit flipped in one byte of one weight
  row moved its products by 4.4e-4 (Q6_K) to 8e-3 (Q4_0) of that size, 200x the bound.
- Plain float activations: ggml's q8_0/q8_1 round as ours does but for the scale's float16,
  2.2e-4 to 2.7e-4 of the products' size apart (each 5e-3 to 8e-3 from the unrounded product);
  q8_K's blocks of 256 round differently, 6e-3 to 1.8e-2 apart, as far as each is from the
  unrounded product.
CI reruns this with the AVX2 kernels forced."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize

from localrun import kernels
from test_kernels import LAYOUTS, TYPES, random_blocks, shape_for

pytestmark = [pytest.mark.numerics,
              pytest.mark.skipif(not kernels.available(), reason="localrun's kernels did not compile here")]

VEC_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_size_t, ctypes.c_void_p,
                           ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class TypeTraitsCpu(ctypes.Structure):
    """ggml-cpu.h's struct ggml_type_traits_cpu."""
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


# what the traits must say for the layout above to be the one read: each type's activation type
# (Q8_0 = 8, Q8_1 = 9, Q8_K = 15) and one row per call on x86
EXPECTED_DOT_TYPE = {QT.Q4_0: 8, QT.Q4_1: 9, QT.Q5_0: 8, QT.Q5_1: 9, QT.Q8_0: 8, QT.Q4_K: 15, QT.Q5_K: 15, QT.Q6_K: 15}
# the largest |ours - ggml| / max |product| allowed for plain float activations, by ggml's
# activation type: ~10x the measured for q8_0/q8_1, ~1.5x for q8_K (docstring)
ALLOWED = {8: 3e-3, 9: 3e-3, 15: 3e-2}
EXACT = 2e-6           # ... and for activations every quantization holds exactly (measured <= 2.6e-7)


@pytest.fixture(scope="module")
def ggml():
    llama_cpp = pytest.importorskip("llama_cpp")
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    try:
        base = ctypes.CDLL(str(lib_dir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        cpu = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        pytest.skip(f"llama-cpp-python's ggml libraries are not loadable here: {e}")
    cpu.ggml_cpu_init.restype = None
    cpu.ggml_cpu_init()                                     # its float16 tables
    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(TypeTraitsCpu)
    cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    base.ggml_row_size.restype = ctypes.c_size_t
    base.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    return cpu, base


def ggml_products(ggml, qtype: QT, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """(M, N): each activation row quantized by ggml's from_float for the type's vec_dot_type,
    times each weight row by ggml's vec_dot."""
    cpu, base = ggml
    traits = cpu.ggml_get_type_traits_cpu(int(qtype)).contents
    if traits.vec_dot_type != EXPECTED_DOT_TYPE[qtype] or traits.nrows != 1:
        pytest.skip(f"this ggml's type traits are not laid out as ggml-cpu.h's struct here "
                    f"(vec_dot_type {traits.vec_dot_type}, nrows {traits.nrows})")
    dot_traits = cpu.ggml_get_type_traits_cpu(traits.vec_dot_type).contents
    from_float, vec_dot = FROM_FLOAT(dot_traits.from_float), VEC_DOT(traits.vec_dot)
    m, k = x.shape
    xq = np.zeros((m, base.ggml_row_size(traits.vec_dot_type, k)), dtype=np.uint8)
    x = np.ascontiguousarray(x, dtype=np.float32)
    for i in range(m):
        from_float(x[i].ctypes.data, xq[i].ctypes.data, k)
    out, s = np.empty((m, raw.shape[0]), dtype=np.float32), ctypes.c_float()
    for i in range(m):
        for j in range(raw.shape[0]):
            vec_dot(k, ctypes.byref(s), 0, raw[j].ctypes.data, 0, xq[i].ctypes.data, 0, 1)
            out[i, j] = s.value
    return out


def exact_activations(m: int, k: int, seed: int) -> np.ndarray:
    """(m, k) float32: integer codes in -127..127 times 2^-6, a +-127 in every block of 32, so
    that q8_0 (float16 scale 2^-6), q8_1, q8_K and localrun's blocks all hold them exactly."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(-126, 127, size=(m, k // 32, 32))
    at = rng.integers(0, 32, size=(m, k // 32, 1))
    np.put_along_axis(codes, at, rng.choice([-127, 127], size=(m, k // 32, 1)), axis=-1)
    assert np.abs(codes.sum(-1)).max() <= 2048             # q8_1's float16 sum of a block stays exact
    return (codes * 2.0 ** -6).reshape(m, k).astype(np.float32)


def compare(ggml, qtype: QT, layout: str, x: np.ndarray, allowed: float) -> None:
    n, k = shape_for(qtype)
    raw = np.ascontiguousarray(random_blocks(qtype, n, k, seed=11))
    theirs = ggml_products(ggml, qtype, raw, x)
    plain = x.astype(np.float64) @ dequantize(raw, qtype).reshape(n, k).astype(np.float64).T
    size = np.abs(plain).max()
    assert np.abs(theirs - plain).max() < 3e-2 * size          # the oracle is read right
    for m in (1, 4, 9, 17):
        ours = kernels.qmatmul(torch.from_numpy(x[:m]), [torch.from_numpy(raw)], [int(qtype) | LAYOUTS[layout]]).numpy()
        gap = np.abs(ours - theirs[:m]).max() / size
        assert gap < allowed, f"M={m}: ours - ggml {gap:.2e} of the products' size (allowed {allowed:.0e})"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_equals_ggml_vec_dot_where_activations_round_exactly(ggml, qtype, layout):
    compare(ggml, qtype, layout, exact_activations(17, shape_for(qtype)[1], seed=12), EXACT)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_near_ggml_vec_dot_on_float_activations(ggml, qtype, layout):
    x = np.random.default_rng(12).standard_normal((17, shape_for(qtype)[1])).astype(np.float32)
    x[5] *= 40.0                                               # a row of another scale
    compare(ggml, qtype, layout, x, ALLOWED[EXPECTED_DOT_TYPE[qtype]])
