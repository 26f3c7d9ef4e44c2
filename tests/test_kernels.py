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
from reference_forward import q8_activations

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


def shape_for(qtype: QT) -> tuple[int, int]:
    """N not a multiple of any tile; K an odd number of 32-groups where the type allows."""
    return (37, 512) if GGML_QUANT_SIZES[qtype][0] == 256 else (37, 96 * 3)


def shapes_for(qtype: QT) -> list[tuple[int, int]]:
    """shape_for, plus an even number of 32-groups for the 32-value types: the AVX-512 path
    decodes those two groups at a time, and an odd last group alone."""
    return [shape_for(qtype)] + ([(37, 320)] if GGML_QUANT_SIZES[qtype][0] == 32 else [])


LAYOUTS = {"rows": 0, "lanes": kernels.LANES}     # the integer kernel's two layouts (a type's LANES bit)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_equals_float64_reference_for_every_row_count(qtype, layout):
    for n, k in shapes_for(qtype):
        raw = random_blocks(qtype, n, k)
        w = dequantize(raw, qtype).reshape(n, k).astype(np.float64)
        x = np.random.default_rng(1).standard_normal((max(ROWS), k)).astype(np.float32)
        x[3, :32] = 0.0                                       # an all-zero block
        for m in ROWS:
            y = kernels.qmatmul(torch.from_numpy(x[:m]), [torch.from_numpy(raw)], [int(qtype) | LAYOUTS[layout]]).numpy()
            exact = q8_activations(x[:m]).astype(np.float64) @ w.T
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
    for rows in (4, 5):               # either side of AVX2's switch from groups to dequantized tiles
        some = kernels.qmatmul_f32(torch.from_numpy(x[:rows]), [torch.from_numpy(raw)], [int(qtype)]).numpy()
        assert np.array_equal(some, y[:rows])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_equals_gguf(qtype):
    n, k = shape_for(qtype)
    raw = random_blocks(qtype, n, k, seed=3)
    got = kernels.dequantize(torch.from_numpy(raw), int(qtype), k).numpy()
    np.testing.assert_allclose(got, dequantize(raw, qtype).reshape(n, k), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rows_are_bit_identical_in_any_batch(layout):
    """A row's output is the same bits alone, in any subset, at any position of the call, in
    either layout (lanes: 8 weight rows side by side, partial tiles at 11, 13, 17 and 3 rows;
    calls of up to a tile pass's rows decode each group and use it at once, larger ones build the
    tile first, and on AVX-512 calls of 16 rows or more multiply two tiles (16 lanes) per register,
    partial second tiles at 11, 13 and 9 rows; one row of the K-quants reads the weight rows
    straight through, Q6_K's 16 at a time, 29 = 16 + 13 of them, and so do AVX-512's calls of 2 to
    4 rows, while its calls of 5 to 8 decode a super-block of 8 weight rows and use it at once:
    all are compared here)."""
    rng = np.random.default_rng(4)
    types = [QT.Q4_K, QT.Q6_K, QT.Q5_1, QT.Q4_1, QT.Q8_0, QT.Q5_K, QT.Q5_0, QT.Q4_0]
    parts = [random_blocks(QT.Q4_K, 40, 512, seed=5), random_blocks(QT.Q6_K, 29, 512, seed=6),
             random_blocks(QT.Q5_1, 11, 512, seed=10), random_blocks(QT.Q4_1, 13, 512, seed=11),
             random_blocks(QT.Q8_0, 9, 512, seed=12), random_blocks(QT.Q5_K, 17, 512, seed=14),
             random_blocks(QT.Q5_0, 8, 512, seed=15), random_blocks(QT.Q4_0, 3, 512, seed=16)]
    weights, qtypes = [torch.from_numpy(p) for p in parts], [int(t) | LAYOUTS[layout] for t in types]
    x = torch.from_numpy(rng.standard_normal((33, 512)).astype(np.float32))
    full = kernels.qmatmul(x, weights, qtypes)
    for m in range(33):
        assert torch.equal(kernels.qmatmul(x[m:m + 1], weights, qtypes)[0], full[m])
    # 2-4 rows: the K-quants' rows read straight through; 5-8: their super-blocks decoded 8 weight
    # rows at a time and used at once (AVX-512); 9 on: tiles
    sizes = [2, 3, 4, 5, 8, 9, *rng.integers(5, 33, size=7)]
    for size in sizes:
        pick = torch.from_numpy(rng.permutation(33)[:size])
        assert torch.equal(kernels.qmatmul(x[pick], weights, qtypes), full[pick])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rows_shared_out_in_chunks_are_the_bits_of_one_thread(layout):
    """A call of at least four chunks (~64 KB of rows each) is shared out among the threads
    (ops.cpp's RowShares: each thread its own share front to back, then chunks off the back of
    another's), so where a row lands changes from call to call: its bits must not. Parts of two
    row sizes and a 37-row one; 1 thread (one pass in order) against 2, 3 and 4."""
    types = [QT.Q4_K, QT.Q6_K, QT.Q4_K]
    parts = [random_blocks(QT.Q4_K, 2000, 256, seed=21), random_blocks(QT.Q6_K, 1500, 256, seed=22),
             random_blocks(QT.Q4_K, 37, 256, seed=23)]
    weights, qtypes = [torch.from_numpy(p) for p in parts], [int(t) | LAYOUTS[layout] for t in types]
    x = torch.randn(17, 256, generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = {m: kernels.qmatmul(x[:m], weights, qtypes) for m in (1, 3, 17)}
        for threads in (2, 3, 4):
            torch.set_num_threads(threads)
            for m, want in alone.items():
                for _ in range(3):
                    assert torch.equal(kernels.qmatmul(x[:m], weights, qtypes), want), (threads, m)
    finally:
        torch.set_num_threads(before)
    ref = x[:3].double() @ torch.cat([torch.from_numpy(dequantize(p, t).reshape(len(p), 256)) for p, t in
                                      zip(parts, types)]).double().T
    torch.testing.assert_close(alone[3].double(), ref, rtol=0, atol=0.02 * ref.abs().max().item())


def test_layouts_agree_up_to_summation_order():
    """The lane layout computes the same sums as the row layout, in another order."""
    for qtype in TYPES:
        n, k = shape_for(qtype)
        raw = torch.from_numpy(random_blocks(qtype, n, k, seed=13))
        x = torch.randn(9, k, generator=torch.Generator().manual_seed(1))
        rows = kernels.qmatmul(x, [raw], [int(qtype)])
        lanes = kernels.qmatmul(x, [raw], [int(qtype) | kernels.LANES])
        torch.testing.assert_close(lanes, rows, rtol=0, atol=4e-6 * rows.abs().max().item(), msg=qtype.name)


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
from test_kernels import TYPES, random_blocks, shapes_for
from reference_forward import q8_activations
from gguf.quants import dequantize
from localrun import kernels
out = {"isa": kernels.isa(), "errors": {}, "rows_identical": True}
for qtype, (n, k) in [(t, s) for t in TYPES for s in shapes_for(t)]:
    raw = random_blocks(qtype, n, k)
    w = dequantize(raw, qtype).reshape(n, k).astype(np.float64)
    x = np.random.default_rng(1).standard_normal((17, k)).astype(np.float32)
    y = kernels.qmatmul(torch.from_numpy(x), [torch.from_numpy(raw)], [int(qtype)])
    exact = q8_activations(x).astype(np.float64) @ w.T
    out["errors"][f"{qtype.name}/{k}"] = float(np.abs(y.numpy() - exact).max() / np.abs(exact).max())
    for m in (0, 5, 16):
        one = kernels.qmatmul(torch.from_numpy(x[m:m + 1]), [torch.from_numpy(raw)], [int(qtype)])
        out["rows_identical"] &= bool(torch.equal(one[0], y[m]))
from test_kernels import attention_reference, BLOCK
rng = np.random.default_rng(0)
kp = torch.from_numpy(rng.standard_normal((4 * BLOCK, 2, 64)).astype(np.float32))
vp = torch.from_numpy(rng.standard_normal((4 * BLOCK, 2, 64)).astype(np.float32))
q = rng.standard_normal((1, 4, 64)).astype(np.float32)
table = np.array([[2, 0, 3, 1]])
got = torch.ops.localrun.paged_attention(torch.from_numpy(q), kp[:1].clone(), vp[:1].clone(), kp, vp, torch.tensor([0]),
                                         torch.from_numpy(table), torch.tensor([0]), torch.tensor([50]), BLOCK, 0)
exact = attention_reference(q[0], kp.numpy(), vp.numpy(), table[0], 50)
out["errors"]["paged_attention"] = float(np.abs(got[0].numpy() - exact).max() / np.abs(exact).max())
print(json.dumps(out))
"""


def runs_avxvnni() -> bool:
    """Whether LOCALRUN_ISA=avxvnni runs here: AVX-VNNI (VEX), or AVX-512 VNNI (its EVEX twin)."""
    flags = cpu_info()["flags"]
    return bool(flags.get("avx2") and (flags.get("avx_vnni") or (flags.get("avx512f") and flags.get("avx512_vnni"))))


@pytest.mark.parametrize("isa", ["avx2", "avxvnni", "ref"])
def test_forced_instruction_sets(isa):
    """The AVX2 path (forced on an AVX-512 host), the AVX-VNNI one (on an AVX-512 host, through
    vpdpbusd's EVEX form) and the scalar reference give the same results."""
    if isa == "avx2" and not cpu_info()["flags"].get("avx2"):
        pytest.skip("this CPU has no AVX2")
    if isa == "avxvnni" and not runs_avxvnni():
        pytest.skip("this CPU has neither AVX-VNNI nor AVX-512 VNNI")
    env = {**os.environ, "LOCALRUN_ISA": isa}
    out = subprocess.run([sys.executable, "-c", ISA_SCRIPT, os.path.dirname(__file__)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["isa"] == isa and result["rows_identical"], result
    assert max(result["errors"].values()) < 2e-6, result


LANES_SCRIPT = """
import hashlib, sys, numpy as np, torch
sys.path.insert(0, sys.argv[1])
from test_kernels import TYPES, random_blocks, shapes_for
from localrun import kernels
digests = []
for lanes, q8 in ((kernels.LANES, False), (0, True), (kernels.LANES, True)):
    # the lane layout (not Q8_0), the rows layout (every type), Q8_0's lanes (VNNI only: else its rows)
    h = hashlib.md5()
    for qtype, (n, k) in [(t, s) for t in TYPES if (lanes == 0 or (t.name == "Q8_0") == q8) for s in shapes_for(t)]:
        x = np.random.default_rng(2).standard_normal((37, k)).astype(np.float32)
        for rows in (37, 13, 3, 1):      # AVX-512: two tiles per register; the tile; decoded and used at once
            y = kernels.qmatmul(torch.from_numpy(x[:rows]), [torch.from_numpy(random_blocks(qtype, n, k))],
                                [int(qtype) | lanes])
            h.update(y.numpy().tobytes())
    digests.append(h.hexdigest())
print(kernels.isa(), *digests)
"""


def test_lanes_give_the_same_bits_on_every_instruction_set():
    """The lane layout's integer sums are exact in AVX2 (maddubs + madd), AVX-VNNI and AVX-512
    VNNI (vpdpbusd), and the float steps are the same instructions, so a lane type's product is
    the same bits on each instruction set: an AVX2 host, an AVX-VNNI one and an AVX-512 one decode
    alike. The AVX-VNNI kernels are AVX2's with vpdpbusd for maddubs + madd, so their rows layout
    gives AVX2's bits too (AVX-512's rows kernels are its own); Q8_0's lanes (VNNI only: its codes
    offset by 128 would saturate maddubs) are the same bits on AVX-VNNI and AVX-512."""
    isas = ["avx2"] + (["avxvnni"] if runs_avxvnni() else []) + (["avx512"] if kernels.isa() == "avx512" else [])
    if len(isas) < 2:
        pytest.skip("this host runs the AVX2 kernels only")
    runs = {}
    for isa in isas:
        out = subprocess.run([sys.executable, "-c", LANES_SCRIPT, os.path.dirname(__file__)],
                             env={**os.environ, "LOCALRUN_ISA": isa}, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        got_isa, lanes, rows, q8_lanes = out.stdout.split()
        assert got_isa == isa
        runs[isa] = (lanes, rows, q8_lanes)
    assert len({lanes for lanes, _, _ in runs.values()}) == 1, runs
    if "avxvnni" in runs:
        assert runs["avxvnni"][1] == runs["avx2"][1], runs
        if "avx512" in runs:
            assert runs["avxvnni"][2] == runs["avx512"][2], runs
        assert runs["avxvnni"][2] != runs["avx2"][2], runs    # AVX2 took its rows: not the same sums


def test_unknown_isa_is_refused():
    env = {**os.environ, "LOCALRUN_ISA": "sse9"}
    out = subprocess.run([sys.executable, "-c", "from localrun import kernels; print(kernels.available())"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False" and "LOCALRUN_ISA must be" in out.stderr


def attention_reference(q, k_pool, v_pool, table, n, window=0):
    """float64 softmax(q k^T / sqrt(hd)) v of one row over positions max(0, n - window)..n-1
    (all n if window is 0), read through the block table; grouped-query heads."""
    bs = BLOCK
    first = max(0, n - window) if window else 0
    positions = np.arange(first, n)
    slots = table[positions // bs] * bs + positions % bs
    H, hd = q.shape
    group = H // k_pool.shape[1]
    out = np.empty((H, hd))
    for h in range(H):
        k = k_pool[slots, h // group].astype(np.float64)
        v = v_pool[slots, h // group].astype(np.float64)
        s = k @ q[h].astype(np.float64) / np.sqrt(hd)
        e = np.exp(s - s.max())
        out[h] = e @ v / e.sum()
    return out


BLOCK = 16


def check_paged_against_float64(rng, hd, n_kv, group, lengths, tables, windows, atol, alone):
    """Decode rows of `lengths` through `tables` against float64 attention, for each window; the
    new K/V land in their slots; each row in `alone` gives the same bits computed on its own."""
    H, num_blocks = n_kv * group, int(tables.max()) + 1
    k_pool = rng.standard_normal((num_blocks * BLOCK, n_kv, hd)).astype(np.float32)
    v_pool = rng.standard_normal((num_blocks * BLOCK, n_kv, hd)).astype(np.float32)
    q = rng.standard_normal((len(lengths), H, hd)).astype(np.float32) * 2
    k = rng.standard_normal((len(lengths), n_kv, hd)).astype(np.float32)
    v = rng.standard_normal((len(lengths), n_kv, hd)).astype(np.float32)
    slots = np.array([tables[i, (n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for i, n in enumerate(lengths)])
    for window in windows:
        kp, vp = torch.from_numpy(k_pool.copy()), torch.from_numpy(v_pool.copy())
        args = lambda rows: (torch.from_numpy(q[rows]), torch.from_numpy(k[rows]), torch.from_numpy(v[rows]), kp, vp,
                             torch.from_numpy(slots[rows]), torch.from_numpy(tables), torch.tensor(rows),
                             torch.tensor([lengths[r] for r in rows]), BLOCK, window)
        out = torch.ops.localrun.paged_attention(*args(list(range(len(lengths))))).numpy()
        assert np.array_equal(kp.numpy()[slots], k) and np.array_equal(vp.numpy()[slots], v)
        for r, n in enumerate(lengths):
            exact = attention_reference(q[r], kp.numpy(), vp.numpy(), tables[r], n, window)
            np.testing.assert_allclose(out[r], exact, rtol=0, atol=atol * max(1.0, np.abs(exact).max()),
                                       err_msg=f"row {r} window {window}")
        for r in alone:
            assert np.array_equal(torch.ops.localrun.paged_attention(*args([r])).numpy()[0], out[r])


@pytest.mark.parametrize("hd, n_kv, group", [(64, 3, 3), (128, 2, 4), (256, 1, 2), (40, 2, 2)])
def test_paged_attention_equals_float64_reference(hd, n_kv, group):
    """Decode rows of several sequences (lengths across block edges, shuffled block tables, with
    and without a window) against float64 attention; each row the same bits alone as in the call;
    the new K/V land in their slots."""
    rng = np.random.default_rng(hd)
    lengths = [1, 7, 16, 17, 40, 95]
    tables = np.stack([rng.permutation(24)[:6] for _ in lengths])
    check_paged_against_float64(rng, hd, n_kv, group, lengths, tables, (0, 20), 2e-6, alone=(0, 3, 5))


def test_paged_attention_of_no_rows_is_empty():
    """A call with no rows (every other op takes them) returns (0, H, hd) and leaves the pools as
    they were: it used to die of a division by zero (SIGFPE) in the thread pool's grain."""
    g = torch.Generator().manual_seed(5)
    k_pool, v_pool = torch.randn(4 * BLOCK, 3, 64, generator=g), torch.randn(4 * BLOCK, 3, 64, generator=g)
    before = (k_pool.clone(), v_pool.clone())
    none = torch.zeros(0, dtype=torch.long)
    out = torch.ops.localrun.paged_attention(torch.randn(0, 9, 64), torch.randn(0, 3, 64), torch.randn(0, 3, 64), k_pool,
                                             v_pool, none, torch.zeros(1, 4, dtype=torch.long), none, none, BLOCK, 0)
    assert out.shape == (0, 9, 64) and out.dtype == torch.float32
    assert torch.equal(k_pool, before[0]) and torch.equal(v_pool, before[1])


@pytest.mark.parametrize("kv_type", ["int8", "fp8"])
@pytest.mark.parametrize("hd", [64, 40])
def test_paged_attention_quantized_pool_writes_as_the_stores_and_reads_their_values(kv_type, hd):
    """int8 (K per block and channel, V per token) and fp8 pools: the kernel quantizes the rows'
    new K/V into the pool byte for byte as the engine's stores write them (an int8 K block
    requantized whole, verify rows crossing a block edge, a row opening a block), then reads the
    pool in place: bit for bit the float32 kernel over the values the stores' own read
    dequantizes (so each value is code * scale, one float32 product)."""
    from localrun.engine import paged_kv
    from localrun.engine.paged_kv import PagedKVCache, WriteTarget
    if kv_type == "fp8" and paged_kv.fp8_dtype() is None:
        pytest.skip("this torch has no float8_e4m3fn")
    g = torch.Generator().manual_seed(hd)
    n_kv, group, num_blocks = 2, 3, 72
    # rows per sequence: one decode row each, 3 verify rows across a block edge (positions
    # 15..17), a row opening a new block (position 32), and rows of a 700-token sequence
    lengths = [1, 9, 16, 16, 17, 18, 33, 40, 95, 700]
    row_seq = [0, 1, 2, 3, 3, 3, 4, 5, 6, 7]
    caches = [PagedKVCache(num_blocks=num_blocks, block_size=BLOCK, n_layers=1, n_head_kv=n_kv, head_dim=hd,
                           kv_type=kv_type, compute_dtype=torch.float32) for _ in range(2)]
    stores = [c.layers[0] for c in caches]
    for b in range(num_blocks):                       # every block written whole, as a prompt would
        target = WriteTarget(torch.arange(b * BLOCK, (b + 1) * BLOCK), torch.tensor([b]), 0)
        k, v = torch.randn(BLOCK, n_kv, hd, generator=g) * 3, torch.randn(BLOCK, n_kv, hd, generator=g)
        for k_store, v_store in stores:
            k_store.write(target, k)
            v_store.write(target, v)
    tables = torch.stack([torch.randperm(num_blocks - 16, generator=g)[:45] + 16 for _ in range(8)])
    for s in range(8):                                 # the blocks written are each sequence's own
        ends = [n for n, seq in zip(lengths, row_seq) if seq == s]
        tables[s, (ends[0] - 1) // BLOCK] = 2 * s
        tables[s, (ends[-1] - 1) // BLOCK] = 2 * s + 1 if (ends[-1] - 1) // BLOCK != (ends[0] - 1) // BLOCK else 2 * s
    slots = torch.tensor([int(tables[s, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK for s, n in zip(row_seq, lengths)])
    q = torch.randn(len(lengths), n_kv * group, hd, generator=g)
    k_new, v_new = torch.randn(len(lengths), n_kv, hd, generator=g) * 3, torch.randn(len(lengths), n_kv, hd, generator=g)
    k_new[0, 0, :5] = 0.0                                                  # an all-zero group keeps a usable scale
    (k_kernel, v_kernel), (k_ref, v_ref) = stores
    out = torch.ops.localrun.paged_attention(q, k_new, v_new, k_kernel.data, v_kernel.data, slots, tables,
                                             torch.tensor(row_seq), torch.tensor(lengths), BLOCK, 0,
                                             k_scale=k_kernel.scale, v_scale=v_kernel.scale)
    for s in sorted(set(row_seq)):                     # the reference: each sequence's rows through the stores
        rows = [r for r, seq in enumerate(row_seq) if seq == s]
        first, end = lengths[rows[0]] - 1, lengths[rows[-1]]
        target = WriteTarget(slots[rows], tables[s, first // BLOCK:(end - 1) // BLOCK + 1], first % BLOCK)
        k_ref.write(target, k_new[rows])
        v_ref.write(target, v_new[rows])
    for got, want in ((k_kernel, k_ref), (v_kernel, v_ref)):
        assert torch.equal(got.data, want.data) and torch.equal(got.scale, want.scale)
    everything = torch.arange(num_blocks)
    kf = k_ref.read(everything, num_blocks * BLOCK, torch.float32)
    vf = v_ref.read(everything, num_blocks * BLOCK, torch.float32)
    for window in (0, 20):
        rest = lambda rows: (slots[rows], tables, torch.tensor([row_seq[r] for r in rows]),
                             torch.tensor([lengths[r] for r in rows]), BLOCK, window)
        rows = list(range(len(lengths)))
        got = torch.ops.localrun.paged_attention(q, k_new, v_new, k_kernel.data.clone(), v_kernel.data.clone(),
                                                 *rest(rows), k_scale=k_kernel.scale.clone(), v_scale=v_kernel.scale.clone())
        same = torch.ops.localrun.paged_attention(q, kf[slots], vf[slots], kf.clone(), vf.clone(), *rest(rows))
        assert torch.equal(got, same), f"window {window}"
        if window == 0:
            assert torch.equal(got, out)
    with pytest.raises(RuntimeError, match="k_scale and v_scale"):
        torch.ops.localrun.paged_attention(q, k_new, v_new, k_kernel.data, v_kernel.data, *rest(rows))


@pytest.mark.parametrize("kv_type", ["int8", "fp8"])
def test_paged_attention_widens_every_code_exactly(kv_type):
    """Every int8 and float8 e4m3fn code (subnormals, both zeros, NaN included) read by the
    kernel is the value torch gives it: each row attends over one stored position whose value
    codes are the ones under test (scale 1) and a new position whose score underflows and
    whose value is 0, so the output is the stored value row itself."""
    from localrun.engine import paged_kv
    from localrun.engine.paged_kv import PagedKVCache
    if kv_type == "fp8" and paged_kv.fp8_dtype() is None:
        pytest.skip("this torch has no float8_e4m3fn")
    hd, rows = 64, 4
    cache = PagedKVCache(num_blocks=rows, block_size=BLOCK, n_layers=1, n_head_kv=1, head_dim=hd, kv_type=kv_type,
                         compute_dtype=torch.float32)
    k_store, v_store = cache.layers[0]
    k_store.data.zero_()
    k_store.scale.fill_(1.0)
    v_store.scale.fill_(1.0)
    codes = torch.arange(256, dtype=torch.uint8) if kv_type == "fp8" else torch.arange(-128, 128).to(torch.int8)
    v_store.data[::BLOCK] = codes.view(rows, 1, hd).view(v_store.data.dtype)      # position 0 of each block
    q = torch.ones(rows, 1, hd)
    k_new = torch.full((rows, 1, hd), -1e4)                                           # score -8e5: e^(s - max) ~ 0
    out = torch.ops.localrun.paged_attention(q, k_new, torch.zeros(rows, 1, hd), k_store.data, v_store.data,
                                             torch.arange(rows) * BLOCK + 1, torch.arange(rows)[:, None],
                                             torch.arange(rows), torch.full((rows,), 2), BLOCK, 0,
                                             k_scale=k_store.scale, v_scale=v_store.scale)
    want = (codes.view(paged_kv.fp8_dtype()) if kv_type == "fp8" else codes).float().view(rows, 1, hd)
    np.testing.assert_array_equal(out.numpy(), want.numpy())


@pytest.mark.parametrize("hd", [64, 40])
def test_paged_attention_long_rows_split_and_merged(hd):
    """Rows longer than the kernel's 512-position chunk are computed in chunks on several threads
    and merged: against float64, with and without a window longer than a chunk, and each row the
    same bits alone as beside other rows."""
    rng = np.random.default_rng(hd + 1)
    lengths, per_seq = [1100, 513, 40, 1030], 70
    tables = rng.permutation(per_seq * len(lengths)).reshape(len(lengths), per_seq)
    check_paged_against_float64(rng, hd, 2, 3, lengths, tables, (0, 700), 3e-6, alone=range(len(lengths)))


@pytest.mark.parametrize("hd, n_kv, group", [(64, 3, 3), (128, 2, 4), (256, 1, 4)])
def test_paged_attention_rows_on_a_shared_prefix_equal_each_row_alone(hd, n_kv, group):
    """Rows whose block tables share blocks (15 sequences on one cached 640-token prefix; three
    of them verify rows of one sequence, the same table to the end), cut in chunks: each row
    equals float64 and is the same bits alone, with and without a window, on 2 threads."""
    rng = np.random.default_rng(hd + 2)
    lengths = [700 + 13 * i for i in range(12)] + [900, 901, 902]
    tables = rng.permutation(60 * len(lengths)).reshape(len(lengths), 60)
    tables[1:, :40] = tables[0, :40]
    tables[13:] = tables[12]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        check_paged_against_float64(rng, hd, n_kv, group, lengths, tables, (0, 300), 3e-6, alone=(0, 5, 11, 12, 14))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kv_type", ["f32", "f16", "int8", "fp8"])
def test_paged_attention_row_alone_equals_row_in_a_full_step(kv_type):
    """A decode row alone (too few rows for the threads: one task per KV head, its heads maybe
    split) and the same row among 16 (one task per row over every KV head, each block read whole)
    give the same bits; the full step equals float64 (16-bit and float32 pools) or, bit for bit,
    the float32 kernel over the values the stores read (int8, fp8). 300 positions, SmolLM2's heads
    (9 over 3 KV heads), 2 threads, so the lone row is above the kernel's serial threshold."""
    from localrun.engine import paged_kv
    from localrun.engine.paged_kv import PagedKVCache, WriteTarget
    if kv_type == "fp8" and paged_kv.fp8_dtype() is None:
        pytest.skip("this torch has no float8_e4m3fn")
    g = torch.Generator().manual_seed(11)
    n_kv, group, hd, rows, n = 3, 3, 64, 16, 300
    per_seq = -(-n // BLOCK)
    num_blocks = rows * per_seq
    tables = torch.randperm(num_blocks, generator=g).view(rows, per_seq)
    if kv_type in ("f32", "f16"):
        dtype = torch.float32 if kv_type == "f32" else torch.float16
        k_pool = torch.randn(num_blocks * BLOCK, n_kv, hd, generator=g).to(dtype)
        v_pool = torch.randn(num_blocks * BLOCK, n_kv, hd, generator=g).to(dtype)
        scales = {}
    else:
        (k_store, v_store), = PagedKVCache(num_blocks=num_blocks, block_size=BLOCK, n_layers=1, n_head_kv=n_kv,
                                           head_dim=hd, kv_type=kv_type, compute_dtype=torch.float32).layers
        for b in range(num_blocks):                   # every block written whole, as a prompt would
            target = WriteTarget(torch.arange(b * BLOCK, (b + 1) * BLOCK), torch.tensor([b]), 0)
            k_store.write(target, torch.randn(BLOCK, n_kv, hd, generator=g) * 3)
            v_store.write(target, torch.randn(BLOCK, n_kv, hd, generator=g))
        k_pool, v_pool = k_store.data, v_store.data
        scales = {"k_scale": k_store.scale, "v_scale": v_store.scale}
    q = torch.randn(rows, n_kv * group, hd, generator=g)
    # each row's new K/V: the values already at its slot (an int8 K block is requantized with them all the same)
    slots = tables[:, (n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK
    if kv_type in ("f32", "f16"):
        k, v = k_pool[slots].float(), v_pool[slots].float()
    else:
        everything = torch.arange(num_blocks)
        k = k_store.read(everything, num_blocks * BLOCK, torch.float32)[slots]
        v = v_store.read(everything, num_blocks * BLOCK, torch.float32)[slots]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        def call(r, kp=k_pool, vp=v_pool, kn=k, vn=v, **sc):   # on copies: the call writes rows and scales
            kp, vp, sc = kp.clone(), vp.clone(), {name: t.clone() for name, t in sc.items()}
            out = torch.ops.localrun.paged_attention(q[r], kn[r], vn[r], kp, vp, slots[r], tables, torch.tensor(r),
                                                     torch.full((len(r),), n), BLOCK, **sc)
            return out, kp, vp, sc
        full, k_written, v_written, written_scales = call(list(range(rows)), **scales)
        for r in (0, 7, 15):
            assert torch.equal(call([r], **scales)[0][0], full[r]), f"row {r}"
        if kv_type in ("f32", "f16"):
            for r in (0, 7, 15):
                exact = attention_reference(q[r].numpy(), k_pool.float().numpy(), v_pool.float().numpy(),
                                            tables[r].numpy(), n)
                np.testing.assert_allclose(full[r].numpy(), exact, rtol=0, atol=2e-6 * max(1.0, np.abs(exact).max()))
        else:   # an int8 K block is requantized with its new row: compare over the pools as written
            for store, data, scale in ((k_store, k_written, written_scales["k_scale"]),
                                       (v_store, v_written, written_scales["v_scale"])):
                store.data.copy_(data)
                store.scale.copy_(scale)
            kf = k_store.read(everything, num_blocks * BLOCK, torch.float32)
            vf = v_store.read(everything, num_blocks * BLOCK, torch.float32)
            assert torch.equal(full, call(list(range(rows)), kf, vf, kf[slots], vf[slots])[0])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kv_type", ["f32", "f16", "bf16", "int8"])
def test_paged_attention_reads_views_of_the_fused_heads(kv_type):
    """decode_block hands q, k and v as narrows of the fused (T, H + 2 n_kv, hd) heads, rows apart:
    the kernel reads them in place (16-bit and float32 pools) or copies them (quantized), and the
    output and every pool byte equal the call on contiguous copies."""
    from localrun.engine.paged_kv import PagedKVCache
    g = torch.Generator().manual_seed(5)
    n_kv, H, hd, rows, n = 3, 9, 64, 5, 40
    per_seq = -(-n // BLOCK)
    num_blocks = rows * per_seq
    tables = torch.randperm(num_blocks, generator=g).view(rows, per_seq)
    slots = tables[:, (n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK
    fused = torch.randn(rows, H + 2 * n_kv + 1, hd, generator=g)        # one spare head: rows further apart
    q, k, v = fused.narrow(1, 0, H), fused.narrow(1, H, n_kv), fused.narrow(1, H + n_kv, n_kv)
    assert not q.is_contiguous() and not k.is_contiguous() and not v.is_contiguous()
    if kv_type == "int8":
        (k_store, v_store), = PagedKVCache(num_blocks=num_blocks, block_size=BLOCK, n_layers=1, n_head_kv=n_kv,
                                           head_dim=hd, kv_type="int8", compute_dtype=torch.float32).layers
        pools = [k_store.data, v_store.data, k_store.scale, v_store.scale]
        for t in pools[:2]:           # the stores start uninitialized: codes and positive scales
            t.copy_(torch.randint(-127, 128, t.shape, generator=g, dtype=torch.int8))
        for t in pools[2:]:
            t.copy_(torch.rand(t.shape, generator=g) * 0.05 + 0.01)
    else:
        dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[kv_type]
        pools = [torch.randn(num_blocks * BLOCK, n_kv, hd, generator=g).to(dtype) for _ in range(2)]

    def call(q, k, v):
        kp, vp, *sc = [t.clone() for t in pools]
        extra = {"k_scale": sc[0], "v_scale": sc[1]} if sc else {}
        out = torch.ops.localrun.paged_attention(q, k, v, kp, vp, slots, tables, torch.arange(rows),
                                                 torch.full((rows,), n), BLOCK, **extra)
        return [out, kp, vp, *sc]
    for got, want in zip(call(q, k, v), call(q.contiguous(), k.contiguous(), v.contiguous())):
        assert torch.isfinite(got.float()).all() and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hd", [64, 40])
def test_paged_attention_16bit_pool_equals_float32_pool_of_its_values(dtype, hd):
    """A float16/bfloat16 pool: the new rows are stored as torch's .to() rounds them, and the output
    is bit for bit the float32 kernel's over the widened pool, so the widening is exact for every
    stored value (subnormals, the largest finite values and signed zeros included)."""
    rng = np.random.default_rng(7)
    n_kv, group, num_blocks, lengths = 2, 3, 12, [1, 9, 16, 33, 70]
    tables = torch.from_numpy(np.stack([rng.permutation(num_blocks)[:5] for _ in lengths]))
    bits = torch.from_numpy(rng.integers(0, 1 << 16, (num_blocks * BLOCK, 2, n_kv, hd), dtype=np.int32))
    pools = bits.to(torch.int16).view(dtype)
    finite = torch.isfinite(pools.float())
    pools = torch.where(finite, pools, torch.zeros((), dtype=dtype))          # no inf/NaN: they would poison sums
    pools = torch.where(pools.float().abs() > 8, pools / 1024, pools).to(dtype)  # scores stay finite
    flat = pools.view(torch.int16).flatten()
    if dtype == torch.float16:       # every subnormal and the extremes appear
        flat[:64] = torch.tensor([1, 0x3ff, 0x8001, 0x83ff, 0x8000, 0x7bff, 0xfbff, 0x0400] * 8, dtype=torch.int32).to(torch.int16)
    k_pool, v_pool = pools[:, 0].contiguous(), pools[:, 1].contiguous()
    q = torch.from_numpy(rng.standard_normal((len(lengths), n_kv * group, hd)).astype(np.float32))
    k = torch.from_numpy(rng.standard_normal((len(lengths), n_kv, hd)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((len(lengths), n_kv, hd)).astype(np.float32))
    slots = torch.tensor([int(tables[i, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK for i, n in enumerate(lengths)])
    for window in (0, 20):
        kp, vp = k_pool.clone(), v_pool.clone()
        rest = (slots, tables, torch.arange(len(lengths)), torch.tensor(lengths), BLOCK, window)
        out = torch.ops.localrun.paged_attention(q, k, v, kp, vp, *rest)
        assert torch.equal(kp[slots].view(torch.int16), k.to(dtype).view(torch.int16))
        assert torch.equal(vp[slots].view(torch.int16), v.to(dtype).view(torch.int16))
        kf, vf = kp.float(), vp.float()
        same = torch.ops.localrun.paged_attention(q, kf[slots], vf[slots], kf, vf, *rest)
        assert torch.equal(out, same), f"window {window}"
        assert torch.isfinite(out).all()


def _rounding_edges(dtype, n, rng) -> torch.Tensor:
    """float32 values where a conversion to dtype can go wrong: exact ties between two neighbours
    (both signs), overflow at and past the largest finite value, results below the smallest
    subnormal, signed zeros, infinities, NaN, and n arbitrary bit patterns."""
    if dtype == torch.float16:
        a = rng.integers(0, 0x7bff, n // 2).astype(np.uint16)
        lo, hi = a.view(np.float16).astype(np.float32), (a + 1).view(np.float16).astype(np.float32)
        ties = (lo + hi) / 2                                              # exact in float32
        special = np.array([65504, 65519.996, 65520, 1e6, 2.0 ** -25, 2.0 ** -25 * 1.0001, 3 * 2.0 ** -26, 2.0 ** -26,
                            1e-30, 0.0, np.inf, np.nan], np.float32)
    else:
        ties = ((rng.integers(0, 0x7f7f, n // 2).astype(np.uint32) << 16) + 0x8000).view(np.float32)
        special = np.array([0x7f7f8000, 0x7f7f7fff, 0x00008000, 0x00018000, 0x00000001, 0x7f800000, 0x7fc00000,
                            0x7f800001, 0], np.uint32).view(np.float32)
    arbitrary = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return torch.from_numpy(np.concatenate([ties, -ties, special, -special, arbitrary]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_pool_writes_round_as_torch_at_the_edges(dtype):
    """The new rows' conversion into a float16/bfloat16 pool (8 at a time with F16C / AVX2, the
    tail one by one) gives torch's .to() bits for every value but NaN: ties to even, subnormal
    results, overflow to infinity, signed zeros; a NaN stays a NaN (its payload is not kept).
    Rows of 44 values, so both the 8-wide loop and its tail run."""
    rng = np.random.default_rng(3)
    x = _rounding_edges(dtype, 3000, rng)
    hd = 44
    T = x.numel() // hd
    k = x[: T * hd].view(T, 1, hd).clone()
    v = k.flip(0).contiguous()
    num_blocks = T // BLOCK + 2
    k_pool = torch.zeros(num_blocks * BLOCK, 1, hd, dtype=dtype)
    v_pool = torch.zeros_like(k_pool)
    tables = torch.arange(num_blocks).view(1, num_blocks)
    torch.ops.localrun.paged_attention(torch.zeros(T, 1, hd), k, v, k_pool, v_pool, torch.arange(T), tables,
                                       torch.zeros(T, dtype=torch.long), torch.arange(1, T + 1), BLOCK, 0)
    for pool, rows in ((k_pool, k), (v_pool, v)):
        got, want = pool[:T], rows.to(dtype)
        nan = torch.isnan(rows)
        assert nan.sum() >= 2 and torch.equal(torch.isnan(got), nan)
        assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


def test_small_ops_equal_float64_reference():
    """silu_mul and gelu_mul (vector exp), rms_norm and add_rms_norm against float64, with a tail under 8
    values and gate values far in both tails of the sigmoid."""
    rng = np.random.default_rng(11)
    for F_, D in ((1536, 576), (13, 21)):
        gu = (rng.standard_normal((3, 2 * F_)) * 6).astype(np.float32)
        gu[0, :4] = [-120.0, -90.0, 95.0, 0.0]
        g, u = gu[:, :F_].astype(np.float64), gu[:, F_:].astype(np.float64)
        exact = g / (1 + np.exp(-g)) * u
        got = torch.ops.localrun.silu_mul(torch.from_numpy(gu)).numpy()
        np.testing.assert_allclose(got, exact, rtol=2e-6, atol=1e-30)
        gelu = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) * u
        got = torch.ops.localrun.gelu_mul(torch.from_numpy(gu)).numpy()
        np.testing.assert_allclose(got, gelu, rtol=1e-5, atol=1e-6 * np.abs(gelu).max())
        x, r = rng.standard_normal((2, 3, D)).astype(np.float32)
        w = rng.standard_normal(D).astype(np.float32)
        def norm(h):
            h = h.astype(np.float64)
            return h / np.sqrt((h ** 2).mean(-1, keepdims=True) + 1e-5) * w
        np.testing.assert_allclose(torch.ops.localrun.rms_norm(torch.from_numpy(x), torch.from_numpy(w), 1e-5).numpy(),
                                   norm(x), rtol=2e-6, atol=1e-6)
        h, n = torch.ops.localrun.add_rms_norm(torch.from_numpy(x), torch.from_numpy(r), torch.from_numpy(w), 1e-5)
        assert np.array_equal(h.numpy(), x + r)
        np.testing.assert_allclose(n.numpy(), norm(x + r), rtol=2e-6, atol=1e-6)


SMALL_OPS_SCRIPT = """
import hashlib, numpy as np, torch
from localrun import kernels
kernels.available()
torch.set_num_threads(2)
rng = np.random.default_rng(3)
ops = torch.ops.localrun
h = hashlib.md5()
for D, F in ((576, 1536), (21, 13)):
    x, r = (torch.from_numpy(rng.standard_normal((2, 33, D)).astype(np.float32) * 3))
    w = torch.from_numpy(rng.standard_normal(D).astype(np.float32))
    gu = torch.from_numpy(rng.standard_normal((33, 2 * F)).astype(np.float32) * 6)
    def run(rows):
        return [ops.rms_norm(x[rows], w, 1e-5), *ops.add_rms_norm(x[rows], r[rows], w, 1e-6),
                ops.silu_mul(gu[rows]), ops.gelu_mul(gu[rows])]
    alone = [run(slice(t, t + 1)) for t in range(33)]
    for T in (2, 3, 8, 9, 16, 17, 33):
        for t0 in (0, 33 - T):
            for got, want in zip(run(slice(t0, t0 + T)), zip(*alone[t0:t0 + T])):
                assert torch.equal(got, torch.cat(want)), (D, T, t0)
    for outs in alone:
        for y in outs:
            h.update(y.numpy().tobytes())
print(h.hexdigest())
"""


def test_small_ops_rows_are_their_own_on_every_instruction_set():
    """rms_norm, add_rms_norm (rows normalized 8 at a time, each row's sum in its own chain),
    silu_mul and gelu_mul (split over the threads by values, 16 lanes in the AVX-512 build): a
    row's bits are the same alone and in calls of 2-33 rows, and the same on AVX-512, AVX2 and
    the scalar baseline."""
    isas = ["avx512", "avx2", "ref"] if cpu_info()["flags"].get("avx512_vnni") else ["avx2", "ref"]
    isas += ["avxvnni"] if runs_avxvnni() else []
    if not cpu_info()["flags"].get("avx2"):
        isas = ["ref"]
    digests = {}
    for isa in isas:
        out = subprocess.run([sys.executable, "-c", SMALL_OPS_SCRIPT], env={**os.environ, "LOCALRUN_ISA": isa},
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        digests[isa] = out.stdout.split()[-1]
    assert len(set(digests.values())) == 1, digests


@pytest.mark.parametrize("neox", [False, True])
def test_rope_equals_the_complex_product(neox):
    """localrun::rope: each pair times its frequency, (a c - b d, a d + b c) with every product
    rounded to float32 before the sum, bit for bit against numpy doing exactly that; within an ulp
    of llama.py's torch expression (whose scalar tail may fuse a product into the sum); on views
    whose heads are apart (a narrow of the fused q/k/v heads) and head sizes not a multiple of 8."""
    from localrun.model.llama import apply_rope
    rng = np.random.default_rng(5)
    for T, H, hd in ((1, 12, 64), (37, 7, 40), (5, 3, 128)):
        heads = torch.from_numpy((rng.standard_normal((T, H + 5, hd)) * 3).astype(np.float32))
        angles = rng.uniform(0, 100, (T, hd // 2))
        freqs = torch.polar(torch.ones(T, hd // 2, dtype=torch.float64), torch.from_numpy(angles)).to(torch.complex64)
        x = heads.narrow(1, 2, H)                                       # rows and heads apart
        got = torch.ops.localrun.rope(x, freqs, neox)
        xn, f = x.numpy(), torch.view_as_real(freqs).numpy()
        c, d = f[:, None, :, 0], f[:, None, :, 1]
        a, b = (xn[..., :hd // 2], xn[..., hd // 2:]) if neox else (xn[..., 0::2], xn[..., 1::2])
        re, im = a * c - b * d, a * d + b * c                           # float32: each product rounded
        want = np.concatenate([re, im], -1) if neox else np.stack([re, im], -1).reshape(T, H, hd)
        assert got.shape == (T, H, hd) and np.array_equal(got.numpy(), want), (T, H, hd)
        np.testing.assert_allclose(got.numpy(), apply_rope(x, freqs, neox).numpy(), rtol=0, atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize("kv_type", ["f16", "int8"])
@pytest.mark.parametrize("hd", [64, 40])
def test_compiled_gather_equals_the_stores_torch_read(kv_type, hd, monkeypatch):
    """A prompt chunk's read of its cached prefix from a float16 or int8 pool (int8: K per block
    and channel, V per token and group) through kernels.gather_kv equals the stores' torch read
    bit for bit: shuffled blocks, a partial last block, one block, none."""
    from localrun.engine import paged_kv
    from localrun.engine.paged_kv import PagedKVCache, WriteTarget
    g = torch.Generator().manual_seed(hd)
    n_kv, num_blocks = 3, 20
    k_store, v_store = PagedKVCache(num_blocks=num_blocks, block_size=BLOCK, n_layers=1, n_head_kv=n_kv, head_dim=hd,
                                    kv_type=kv_type, compute_dtype=torch.float32).layers[0]
    for b in range(num_blocks):
        target = WriteTarget(torch.arange(b * BLOCK, (b + 1) * BLOCK), torch.tensor([b]), 0)
        k_store.write(target, torch.randn(BLOCK, n_kv, hd, generator=g) * 3)
        v_store.write(target, torch.randn(BLOCK, n_kv, hd, generator=g))
    expected = ("ChannelScaledStore", "TokenScaledStore") if kv_type == "int8" else ("PlainStore", "PlainStore")
    assert (type(k_store).__name__, type(v_store).__name__) == expected
    calls, gather = [], kernels.gather_kv

    def counted(*args, **options):
        calls.append(1)
        return gather(*args, **options)
    monkeypatch.setattr(kernels, "gather_kv", counted)
    for ids, n in ((torch.randperm(num_blocks, generator=g)[:7], 7 * BLOCK - 5), (torch.tensor([3]), 1),
                   (torch.tensor([19, 0]), 2 * BLOCK), (torch.tensor([], dtype=torch.long), 0)):
        for store in (k_store, v_store):
            compiled = store.read(ids, n, torch.float32)
            with monkeypatch.context() as m:
                m.setattr(paged_kv, "_compiled_kv", lambda data: False)
                reference = store.read(ids, n, torch.float32)
            assert compiled.shape == reference.shape == (n, n_kv, hd)
            assert torch.equal(compiled, reference), (type(store).__name__, ids.tolist(), n)
    assert len(calls) == 8          # every read above went through the compiled gather


@pytest.mark.parametrize("kv_type", ["int8", "fp8"])
@pytest.mark.parametrize("hd", [64, 40])
def test_compiled_write_equals_the_stores_torch_write(kv_type, hd, monkeypatch):
    """A sequence's rows written into an int8 or fp8 pool through kernels.write_kv (int8 K: each
    block written requantized whole with its earlier tokens; V and fp8: per token and group) give
    the bytes and scales of the stores' torch write, chunk after chunk: a partial first block,
    chunks across blocks, single rows, over a shuffled block table; nothing else in the pool moves."""
    from localrun.engine import paged_kv
    from localrun.engine.paged_kv import PagedKVCache
    if kv_type == "fp8" and paged_kv.fp8_dtype() is None:
        pytest.skip("this torch has no float8_e4m3fn")
    g = torch.Generator().manual_seed(hd + len(kv_type))
    n_kv, num_blocks = 3, 12

    def stores():
        return PagedKVCache(num_blocks=num_blocks, block_size=BLOCK, n_layers=1, n_head_kv=n_kv, head_dim=hd,
                            kv_type=kv_type, compute_dtype=torch.float32).layers[0]
    compiled, reference = stores(), stores()
    for a, b in zip(compiled, reference):            # the same prior contents, written by nobody
        for x, y in zip(a.tensors(), b.tensors()):
            noise = (torch.randint(-127, 128, x.shape, generator=g).to(x.dtype) if x.dtype != torch.float32
                     else torch.rand(x.shape, generator=g) + 0.01)
            x.copy_(noise), y.copy_(noise)
    calls, write = [], kernels.write_kv

    def counted(*args, **options):
        calls.append(1)
        return write(*args, **options)
    monkeypatch.setattr(kernels, "write_kv", counted)
    table = torch.randperm(num_blocks, generator=g)[:6]
    chunks = [(0, 13), (13, 40), (40, 41), (41, 42), (42, 80), (80, 96)]
    for start, end in chunks:
        positions = torch.arange(start, end)
        slots = table[positions // BLOCK] * BLOCK + positions % BLOCK
        target = paged_kv.WriteTarget(slots, table[start // BLOCK:-(-end // BLOCK)], start % BLOCK)
        scale = 3.0 if start % 2 else 0.5
        k, v = torch.randn(end - start, n_kv, hd, generator=g) * scale, torch.randn(end - start, n_kv, hd, generator=g)
        k[:, 0, :4] = 0                                   # an all-zero group and channel run
        for got, want, x in ((compiled[0], reference[0], k), (compiled[1], reference[1], v)):
            got.write(target, x)
            with monkeypatch.context() as m:
                m.setattr(paged_kv, "_compiled_kv", lambda data: False)
                want.write(target, x)
            for name, a, b in zip(("data", "scale"), got.tensors(), want.tensors()):
                assert torch.equal(a, b), (type(got).__name__, name, start, end)
    assert len(calls) == 2 * len(chunks)              # every write above went through the kernel


@pytest.mark.parametrize("hd", [64, 44])
def test_int8_k_decode_writes_keep_or_requantize_a_block_as_the_store_does(hd, monkeypatch):
    """One row at a time into int8 K blocks (decode steps), through kernels.write_kv against the
    store's torch write, bytes and scales: scales that are powers of two with a +-127 code in
    every channel, so that small new rows leave a channel's scale bit for bit as it was (the
    kernel then leaves the earlier codes in place) and large ones grow it in some channels only;
    earlier codes of -128 (which the store clamps to -127 when it requantizes); head sizes whose
    channels end in a part of 8."""
    from localrun.engine import paged_kv
    from localrun.engine.paged_kv import PagedKVCache, WriteTarget
    g = torch.Generator().manual_seed(hd)
    n_kv, num_blocks = 3, 6
    stores = [PagedKVCache(num_blocks=num_blocks, block_size=BLOCK, n_layers=1, n_head_kv=n_kv, head_dim=hd,
                           kv_type="int8", compute_dtype=torch.float32).layers[0][0] for _ in range(2)]
    compiled, reference = stores
    assert type(compiled).__name__ == "ChannelScaledStore"
    codes = torch.randint(-127, 128, compiled.data.shape, generator=g, dtype=torch.int8)
    codes.view(num_blocks, BLOCK, n_kv, hd)[:, 0] = 127                       # every channel's largest code
    codes.view(num_blocks, BLOCK, n_kv, hd)[:, 1] = -127
    codes.view(num_blocks, BLOCK, n_kv, hd)[4, 2, 1, 5:9] = -128              # not a code the store writes
    scale = 2.0 ** torch.randint(-6, 2, compiled.scale.shape, generator=g).float()
    for store in stores:
        store.data.copy_(codes), store.scale.copy_(scale)
    calls, write = [], kernels.write_kv

    def counted(*args, **options):
        calls.append(1)
        return write(*args, **options)
    monkeypatch.setattr(kernels, "write_kv", counted)
    for b in range(num_blocks):
        for off in range(2, 7):
            x = torch.randn(1, n_kv, hd, generator=g) * 0.01                  # under every scale: nothing grows
            if off == 4:
                x[0, :, : hd // 3] *= 1e4                                     # some channels grow, not all
            target = WriteTarget(torch.tensor([b * BLOCK + off]), torch.tensor([b]), off)
            compiled.write(target, x)
            with monkeypatch.context() as m:
                m.setattr(paged_kv, "_compiled_kv", lambda data: False)
                reference.write(target, x)
            assert torch.equal(compiled.data, reference.data), (b, off)
            assert torch.equal(compiled.scale.view(torch.int32), reference.scale.view(torch.int32)), (b, off)
    assert len(calls) == num_blocks * 5


def test_fp8_pool_writes_round_as_torch_over_the_whole_range():
    """The float8 e4m3fn codes a quantized pool's write gives (kernels.write_kv, one scale per 32
    values) equal torch's .to(torch.float8_e4m3fn) of value / scale: each group holds 448 (so its
    scale is exactly 1) and arbitrary float32 bit patterns of magnitude up to 448, fp8's
    subnormals and the ties between its neighbouring codes, signed zeros and a NaN (the scale
    passes over it; the code is NaN)."""
    from localrun.engine import paged_kv
    if paged_kv.fp8_dtype() is None:
        pytest.skip("this torch has no float8_e4m3fn")
    rng = np.random.default_rng(8)
    codes = np.arange(256, dtype=np.uint8)
    finite = torch.from_numpy(codes).view(torch.float8_e4m3fn).float()
    finite = finite[torch.isfinite(finite)].sort().values
    ties = ((finite[1:] + finite[:-1]) / 2).numpy()                    # halfway between neighbours
    arbitrary = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    arbitrary = arbitrary[np.isfinite(arbitrary) & (np.abs(arbitrary) <= 448)]
    values = np.concatenate([ties, -ties, finite.numpy(), arbitrary, np.float32([0.0, -0.0, 2.0**-10, -(2.0**-9) * 3,
                                                                                   np.nan])]).astype(np.float32)
    per = 31                                                          # each group: 448 and 31 values
    values = np.concatenate([values, np.zeros(-len(values) % per, np.float32)]).reshape(-1, per)
    groups = np.concatenate([np.full((len(values), 1), 448.0, np.float32), values], axis=1)
    T = -(-len(groups) // 2)                                          # two groups of 32 per token (hd 64)
    groups = np.concatenate([groups, np.full((2 * T - len(groups), 32), 448.0, np.float32)])
    x = torch.from_numpy(groups.reshape(T, 1, 64).copy())
    slots = -(-T // BLOCK) * BLOCK                                     # the pool: whole blocks
    data = torch.zeros(slots, 1, 64, dtype=torch.uint8)
    scale = torch.zeros(slots, 1, 2)
    kernels.write_kv(x, data, scale, torch.arange(T), BLOCK, per_block=False, fp8=True)
    data, scale = data[:T], scale[:T]
    assert torch.equal(scale, torch.ones_like(scale))
    want = x.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(data, want), (x[data != want][:8], data[data != want][:8], want[data != want][:8])


def test_topk_kernel_equals_torch_topk_ties_lowest_index_first():
    """kernels.topk (the sampler's candidates) against a stable sort: the n largest values in
    descending order, ties by lowest index, for random rows, rows full of ties, masked (-inf)
    logits, rows whose n-th value is -inf, and n from 1 to V; without ties, torch.topk's ids too.
    A row with a NaN returns torch.topk's own result."""
    rng = np.random.default_rng(7)
    rows = []
    for V in (1, 7, 8, 9, 100, 49152):
        rows.append(rng.standard_normal(V).astype(np.float32) * 4)
        rows.append(rng.integers(-3, 4, V).astype(np.float32))                  # many ties
        masked = rng.standard_normal(V).astype(np.float32)
        masked[rng.random(V) < 0.9] = -np.inf
        rows.append(masked)
    for x in rows:
        V = len(x)
        stable = np.lexsort((np.arange(V), -x.astype(np.float64)))            # value desc, index asc
        for n in sorted({1, min(V, 2), min(V, 8), min(V, 41), V}):
            values, ids = kernels.topk(torch.from_numpy(x), n)
            assert ids.dtype == torch.long and values.shape == ids.shape == (n,)
            assert np.array_equal(ids.numpy(), stable[:n]), (V, n)
            assert np.array_equal(values.numpy(), x[stable[:n]]), (V, n)
            if len(np.unique(x)) == V:                                       # no ties: torch's ids as well
                want = torch.topk(torch.from_numpy(x), n)
                assert torch.equal(values, want.values) and torch.equal(ids, want.indices)
    x = torch.from_numpy(rng.standard_normal(1000).astype(np.float32))
    for at in (0, 500, 999):
        y = x.clone()
        y[at] = float("nan")
        got, want = kernels.topk(y, 10), torch.topk(y, 10)
        assert torch.equal(got[1], want.indices) and torch.allclose(got[0], want.values, equal_nan=True)


def test_library_is_keyed_by_its_sources(tmp_path):
    """Another version of the sources (benchmarks/kernel_ab.py) gets its own library: a copy of
    csrc/ keys the same as csrc/, one changed byte a different key."""
    import shutil

    from localrun.kernels.build import CSRC, library_path
    copy = tmp_path / "csrc"
    shutil.copytree(CSRC, copy)
    assert library_path(copy) == library_path()
    (copy / "ops.cpp").write_bytes((copy / "ops.cpp").read_bytes() + b"\n")
    assert library_path(copy) != library_path() and library_path(copy).name == library_path().name


def test_a_library_named_by_the_environment_is_loaded_instead(tmp_path):
    """LOCALRUN_KERNEL_LIBRARY loads that file rather than building; one that is not a library
    leaves the kernels off with one line saying why, not a traceback."""
    env = {**os.environ, "LOCALRUN_KERNEL_LIBRARY": str(tmp_path / "missing.so")}
    out = subprocess.run([sys.executable, "-c", "from localrun import kernels; print(kernels.available())"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False" and "missing.so" in out.stderr and "Traceback" not in out.stderr
    env["LOCALRUN_KERNEL_LIBRARY"] = str(kernels.build())
    out = subprocess.run([sys.executable, "-c", "from localrun import kernels; print(kernels.available(), kernels.isa())"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split()[0] == "True", out.stderr
