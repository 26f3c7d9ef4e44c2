"""localrun's compiled kernels (localrun/kernels) against references:
- the dequantize-to-float64 reference (gguf-py's numpy dequantization) with the activations
  quantized to 8-bit blocks by a numpy reference: equal up to float32 rounding;
- the plain activations: within the 8-bit activation error;
- rows bit-identical whatever else shares the call, on every instruction set the CPU has
  (the AVX2 path forced on an AVX-512 host with LOCALRUN_ISA, and the scalar reference).
Block contents are random bytes with finite scales, so every code value occurs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize

from localrun import kernels
from localrun.cpu_info import cpu_info

pytestmark = [pytest.mark.numerics,
              pytest.mark.skipif(not kernels.available(), reason="localrun's kernels did not compile here")]

TYPES = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K]
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64]
F16_FIELDS = {QT.Q4_0: [0], QT.Q5_0: [0], QT.Q8_0: [0], QT.Q4_1: [0, 2], QT.Q5_1: [0, 2],
              QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [208]}


def random_blocks(qtype: QT, n: int, k: int, seed: int = 0) -> np.ndarray:
    """(n, bytes per row) of random blocks whose f16 scales are finite, positive and small."""
    rng = np.random.default_rng(seed)
    values, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // values, size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        scale = rng.uniform(0.001, 0.03, size=(n, k // values)).astype(np.float16)
        raw[:, :, at:at + 2] = scale.view(np.uint8).reshape(n, k // values, 2)
    return raw.reshape(n, -1)


def q8_reference(x: np.ndarray) -> np.ndarray:
    """The activations as the kernels see them: per 32 values, d = amax / 127 and
    q = round-half-even(x * 127 / amax), in float32 as the kernels compute them."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32).astype(np.float32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return (np.rint(blocks * inv) * (amax / np.float32(127))).reshape(m, k)


def shape_for(qtype: QT) -> tuple[int, int]:
    """N not a multiple of any tile; K an odd number of 32-groups where the type allows."""
    return (37, 512) if GGML_QUANT_SIZES[qtype][0] == 256 else (37, 96 * 3)


def shapes_for(qtype: QT) -> list[tuple[int, int]]:
    """shape_for, plus an even number of 32-groups for the 32-value types: the AVX-512 path
    decodes those two groups at a time, and an odd last group alone."""
    return [shape_for(qtype)] + ([(37, 320)] if GGML_QUANT_SIZES[qtype][0] == 32 else [])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_equals_float64_reference_for_every_row_count(qtype):
    for n, k in shapes_for(qtype):
        raw = random_blocks(qtype, n, k)
        w = dequantize(raw, qtype).reshape(n, k).astype(np.float64)
        x = np.random.default_rng(1).standard_normal((max(ROWS), k)).astype(np.float32)
        x[3, :32] = 0.0                                       # an all-zero block
        for m in ROWS:
            y = kernels.qmatmul(torch.from_numpy(x[:m]), [torch.from_numpy(raw)], [int(qtype)]).numpy()
            exact = q8_reference(x[:m]).astype(np.float64) @ w.T
            np.testing.assert_allclose(y, exact, rtol=0, atol=2e-6 * np.abs(exact).max(), err_msg=f"M={m} K={k}")
            plain = x[:m].astype(np.float64) @ w.T            # the 8-bit activations' own error
            assert np.linalg.norm(y - plain) / np.linalg.norm(plain) < 1.5e-2


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_float_activation_matmul_equals_float64_reference(qtype):
    """qmatmul_f32 (prompt rows): x in float32 times the file's weights, no 8-bit rounding;
    each row the same bits alone as in a batch."""
    n, k = shape_for(qtype)
    raw = random_blocks(qtype, n, k, seed=9)
    w = dequantize(raw, qtype).reshape(n, k).astype(np.float64)
    x = np.random.default_rng(2).standard_normal((17, k)).astype(np.float32)
    y = kernels.qmatmul_f32(torch.from_numpy(x), [torch.from_numpy(raw)], [int(qtype)]).numpy()
    exact = x.astype(np.float64) @ w.T
    np.testing.assert_allclose(y, exact, rtol=0, atol=2e-6 * np.abs(exact).max())
    for m in (0, 7, 16):
        one = kernels.qmatmul_f32(torch.from_numpy(x[m:m + 1]), [torch.from_numpy(raw)], [int(qtype)]).numpy()
        assert np.array_equal(one[0], y[m])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_equals_gguf(qtype):
    n, k = shape_for(qtype)
    raw = random_blocks(qtype, n, k, seed=3)
    got = kernels.dequantize(torch.from_numpy(raw), int(qtype), k).numpy()
    np.testing.assert_allclose(got, dequantize(raw, qtype).reshape(n, k), rtol=1e-6, atol=1e-7)


def test_rows_are_bit_identical_in_any_batch():
    """A row's output is the same bits alone, in any subset, at any position of the call."""
    rng = np.random.default_rng(4)
    parts = [random_blocks(QT.Q4_K, 40, 512, seed=5), random_blocks(QT.Q6_K, 24, 512, seed=6),
             random_blocks(QT.Q5_1, 11, 512, seed=10)]
    weights, qtypes = [torch.from_numpy(p) for p in parts], [int(QT.Q4_K), int(QT.Q6_K), int(QT.Q5_1)]
    x = torch.from_numpy(rng.standard_normal((33, 512)).astype(np.float32))
    full = kernels.qmatmul(x, weights, qtypes)
    for m in range(33):
        assert torch.equal(kernels.qmatmul(x[m:m + 1], weights, qtypes)[0], full[m])
    for _ in range(10):
        pick = torch.from_numpy(rng.permutation(33)[:rng.integers(2, 33)])
        assert torch.equal(kernels.qmatmul(x[pick], weights, qtypes), full[pick])


def test_fused_parts_equal_separate_calls():
    raw = [random_blocks(QT.Q4_0, 20, 288, seed=7), random_blocks(QT.Q8_0, 9, 288, seed=8)]
    x = torch.randn(5, 288, generator=torch.Generator().manual_seed(0))
    fused = kernels.qmatmul(x, [torch.from_numpy(r) for r in raw], [int(QT.Q4_0), int(QT.Q8_0)])
    alone = [kernels.qmatmul(x, [torch.from_numpy(r)], [int(t)]) for r, t in zip(raw, (QT.Q4_0, QT.Q8_0))]
    assert torch.equal(fused, torch.cat(alone, dim=1))


def test_bad_shapes_are_refused():
    raw = torch.from_numpy(random_blocks(QT.Q4_0, 4, 64))
    with pytest.raises(RuntimeError, match="bytes per row"):
        kernels.qmatmul(torch.randn(2, 96), [raw], [int(QT.Q4_0)])
    with pytest.raises(RuntimeError, match="has no kernel"):
        kernels.qmatmul(torch.randn(2, 64), [raw], [int(QT.IQ4_NL)])


ISA_SCRIPT = """
import json, sys, numpy as np, torch
sys.path.insert(0, sys.argv[1])
from test_kernels import TYPES, random_blocks, shapes_for, q8_reference
from gguf.quants import dequantize
from localrun import kernels
out = {"isa": kernels.isa(), "errors": {}, "rows_identical": True}
for qtype, (n, k) in [(t, s) for t in TYPES for s in shapes_for(t)]:
    raw = random_blocks(qtype, n, k)
    w = dequantize(raw, qtype).reshape(n, k).astype(np.float64)
    x = np.random.default_rng(1).standard_normal((17, k)).astype(np.float32)
    y = kernels.qmatmul(torch.from_numpy(x), [torch.from_numpy(raw)], [int(qtype)])
    exact = q8_reference(x).astype(np.float64) @ w.T
    out["errors"][f"{qtype.name}/{k}"] = float(np.abs(y.numpy() - exact).max() / np.abs(exact).max())
    for m in (0, 5, 16):
        one = kernels.qmatmul(torch.from_numpy(x[m:m + 1]), [torch.from_numpy(raw)], [int(qtype)])
        out["rows_identical"] &= bool(torch.equal(one[0], y[m]))
print(json.dumps(out))
"""


@pytest.mark.parametrize("isa", ["avx2", "ref"])
def test_forced_instruction_sets(isa):
    """The AVX2 path (forced on an AVX-512 host) and the scalar reference give the same results."""
    if isa == "avx2" and not cpu_info()["flags"].get("avx2"):
        pytest.skip("this CPU has no AVX2")
    env = {**os.environ, "LOCALRUN_ISA": isa}
    out = subprocess.run([sys.executable, "-c", ISA_SCRIPT, os.path.dirname(__file__)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["isa"] == isa and result["rows_identical"], result
    assert max(result["errors"].values()) < 2e-6, result


def test_unknown_isa_is_refused():
    env = {**os.environ, "LOCALRUN_ISA": "sse9"}
    out = subprocess.run([sys.executable, "-c", "from localrun import kernels; print(kernels.available())"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False" and "LOCALRUN_ISA must be" in out.stderr
