"""The prompt attention kernels (csrc/prompt_attention.cpp) against a float64 reference.

attention_bf16 rounds queries, keys, values and the softmax weights to bfloat16 and keeps every
sum in float32. Against float64 attention over the same rounded queries, keys and values, the
scores (so the log-sum-exp) agree to float32 rounding, which catches a key too many or too few
under the mask; the output differs only by the weights' rounding: each weight within
bfloat16's unit roundoff u = 2^-8 of its value, so at most 2u max|v| (with the float32 sums'
error far below). attention_f32 rounds nothing: against float64 attention over its own inputs,
the log-sum-exp to the same 2e-6 and the output to float32 sums' error (each weight within a
few float32 roundings: the output within 1e-5 max|v|)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from fidelity import fidelity

from localrun import kernels

pytestmark = pytest.mark.numerics
needs_bf16 = pytest.mark.skipif(not kernels.has_attention_bf16(),
                                reason="no AVX-512 BF16 here (or LOCALRUN_ISA forces a narrower set)")
needs_f32 = pytest.mark.skipif(not kernels.has_attention_f32(), reason="no AVX2 here (or LOCALRUN_ISA=ref)")
KINDS = [pytest.param("bf16", marks=needs_bf16), pytest.param("f32", marks=needs_f32)]

U = 2.0 ** -8          # bfloat16's unit roundoff
F32_BOUND = 1e-5       # attention_f32's output error over max|v|


def attention(kind: str):
    return kernels.attention_bf16 if kind == "bf16" else kernels.attention_f32


def inputs(kind: str, *xs):
    """What the kernel multiplies: bfloat16-rounded (bf16) or the float32 inputs themselves."""
    return tuple(x.bfloat16().float() if kind == "bf16" else x for x in xs)


def reference(q, k, v, offset: int, scale: float, window: int = 0):
    """float64 attention of q, k, v: query i sees keys 0 .. offset + i (with a window, only those
    after offset + i - window)."""
    T, Hq, _ = q.shape
    Hkv, L, _ = k.shape
    q, k, v = (x.double() for x in (q, k, v))
    k, v = k.repeat_interleave(Hq // Hkv, 0), v.repeat_interleave(Hq // Hkv, 0)
    s = torch.einsum("thd,hld->thl", q, k) * scale
    key, last = torch.arange(L)[None, None, :], torch.arange(T)[:, None, None] + offset
    if offset >= 0:
        s = s.masked_fill(key > last, float("-inf"))
    if window:
        s = s.masked_fill(key <= last - window, float("-inf"))
    return torch.einsum("thl,hld->thd", torch.softmax(s, -1), v), torch.logsumexp(s, -1)


CASES = [   # T, query heads, KV heads, head size, keys, offset (-1: no mask), window (0: none)
    (5, 9, 3, 64, 37, -1, 0),           # a few rows over a cached prefix (cascade)
    (40, 9, 3, 64, 1064, 1024, 0),      # a chunk after 1024 cached keys
    (17, 14, 2, 64, 17, 0, 0),          # a whole prompt, causal; 7 query heads per KV head
    (33, 4, 1, 256, 300, 267, 0),       # gemma-3's head size, one KV head
    (1, 8, 8, 128, 70, -1, 0),          # one row, no grouping
    (50, 4, 2, 64, 50, 0, 0),           # keys not a multiple of 16, rows not a multiple of a task's
    (3, 4, 2, 64, 80, 20, 0),           # rows that see only the first keys of the pool
    (300, 4, 1, 256, 300, 0, 37),       # a sliding-window layer's prompt: keys i - 36 .. i
    (90, 4, 2, 128, 150, 60, 100),      # a window over cached keys and the chunk's own
    (4, 4, 2, 64, 16, 12, 4),           # a window whose first key (9) is past the first 8 of 16
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("T,Hq,Hkv,D,L,offset,window", CASES)
def test_attention_equals_float64_over_its_inputs(kind, T, Hq, Hkv, D, L, offset, window):
    g = torch.Generator().manual_seed(T * 1000 + L)
    q, k, v = (torch.randn(*shape, generator=g) * 2 for shape in ((T, Hq, D), (Hkv, L, D), (Hkv, L, D)))
    scale = 1 / math.sqrt(D)
    out, lse = attention(kind)(q, k, v, offset, scale, window)
    ref_out, ref_lse = reference(*inputs(kind, q, k, v), offset, scale, window)
    assert out.shape == (T, Hq, D) and lse.shape == (T, Hq) and out.dtype == lse.dtype == torch.float32
    np.testing.assert_allclose(lse.double().numpy(), ref_lse.numpy(), rtol=2e-6, atol=2e-6)
    v_max = inputs(kind, v)[0].abs().max().item()
    bound = (2 * U if kind == "bf16" else F32_BOUND) * v_max
    assert (out.double() - ref_out).abs().max().item() <= bound


@pytest.mark.parametrize("kind", KINDS)
def test_attention_of_one_key_returns_its_value(kind):
    """With one visible key the softmax weight is exactly 1: the output is that key's value as
    the kernel multiplies it (rows i of a causal call with offset 0 see keys 0..i; row 0 sees
    only key 0)."""
    q, k, v = torch.randn(4, 2, 64), torch.randn(1, 4, 64), torch.randn(1, 4, 64)
    out, _ = attention(kind)(q, k, v, 0, 0.125)
    torch.testing.assert_close(out[0], inputs(kind, v)[0][0, 0].expand(2, 64), rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_attention_refuses_what_it_cannot_compute(kind):
    q, k = torch.randn(2, 4, 8), torch.randn(2, 8, 8)
    with pytest.raises(RuntimeError, match="multiple of 64" if kind == "bf16" else "multiple of 16"):
        attention(kind)(q, k, k, -1, 0.1)
    q, k = torch.randn(2, 3, 64), torch.randn(2, 8, 64)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        attention(kind)(q, k, k, -1, 0.1)
    q = torch.randn(2, 4, 64)
    with pytest.raises(RuntimeError, match="window needs a causal offset"):
        attention(kind)(q, k, k, -1, 0.1, 4)


def shared_attention(kind: str):
    return kernels.attention_shared_bf16 if kind == "bf16" else kernels.attention_shared_f32


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_keeps_its_bits_wherever_its_keys_start_and_whatever_rows_share_its_call(kind):
    """The key grid: rows over keys that start at another position (a sliding-window layer's
    keys trimmed to the first its rows can see, `lead` = that position mod 64), or in another
    split of the chunk, get the same bits as in one call over every key from position 0."""
    g = torch.Generator().manual_seed(11)
    T, Hq, Hkv, D, L, w = 23, 4, 2, 64, 300, 100
    q, k, v = (torch.randn(*shape, generator=g) for shape in ((T, Hq, D), (Hkv, L, D), (Hkv, L, D)))
    offset = L - T                                     # query i at position L - T + i
    full, full_lse = attention(kind)(q, k, v, offset, 0.125, w)
    for first in (1, 37, 64, 150, offset - w + 1):     # offset - w + 1: the first key row 0 sees
        out, lse = attention(kind)(q, k[:, first:], v[:, first:], offset - first, 0.125, w, first % 64)
        assert torch.equal(out, full) and torch.equal(lse, full_lse), first
    for split in (1, 7, 16):                           # rows 0 .. split - 1, then the others, on keys from 131
        a, _ = attention(kind)(q[:split], k[:, 131:], v[:, 131:], offset - 131, 0.125, w, 131 % 64)
        b, _ = attention(kind)(q[split:], k[:, 131:], v[:, 131:], offset + split - 131, 0.125, w, 131 % 64)
        assert torch.equal(torch.cat([a, b]), full), split
    causal, _ = attention(kind)(q, k, v, offset, 0.125)
    tail, _ = attention(kind)(q[5:], k, v, offset + 5, 0.125)   # a chunk's last rows alone
    assert torch.equal(tail, causal[5:])
    # keys and values as the engine's gather hands them: (L, Hkv, D) transposed, read with its strides
    k_t, v_t = k.transpose(0, 1).contiguous().transpose(0, 1), v.transpose(0, 1).contiguous().transpose(0, 1)
    strided, _ = attention(kind)(q, k_t[:, 37:], v_t[:, 37:], offset - 37, 0.125, w, 37)
    assert not k_t.is_contiguous() and torch.equal(strided, full)


@pytest.mark.parametrize("kind", KINDS)
def test_shared_prefix_rows_get_the_bits_of_one_call_over_their_keys(kind):
    """Cascade attention: sequences' rows over a shared prefix (packed once) and their own keys
    get exactly what each gets from one call over the prefix and its keys together."""
    g = torch.Generator().manual_seed(12)
    Hq, Hkv, D, S = 6, 2, 64, 128
    k_pre, v_pre = torch.randn(Hkv, S, D, generator=g), torch.randn(Hkv, S, D, generator=g)
    own = [(5, 5), (3, 70), (40, 131), (1, 64)]        # (rows, own keys): rows are the last of their keys
    qs = [torch.randn(t, Hq, D, generator=g) for t, _ in own]
    k_own = [torch.randn(Hkv, n, D, generator=g) for _, n in own]
    v_own = [torch.randn(Hkv, n, D, generator=g) for _, n in own]
    out = shared_attention(kind)(torch.cat(qs), k_pre, v_pre, k_own, v_own, [t for t, _ in own], 0.125)
    for got, q, k, v, (t, n) in zip(out.split([t for t, _ in own]), qs, k_own, v_own, own):
        alone, _ = attention(kind)(q, torch.cat([k_pre, k], 1), torch.cat([v_pre, v], 1), S + n - t, 0.125)
        assert torch.equal(got, alone), (t, n)
    with pytest.raises(RuntimeError, match="multiple of 64 keys"):
        shared_attention(kind)(qs[0], k_pre[:, :100], v_pre[:, :100], k_own[:1], v_own[:1], [5], 0.125)
    with pytest.raises(RuntimeError, match="rows are q's rows"):
        shared_attention(kind)(torch.cat(qs), k_pre, v_pre, k_own[:1], v_own[:1], [5], 0.125)


def quantized_pools(kv_type: str, n_blocks: int, bs: int, Hkv: int, D: int, g: torch.Generator):
    """Random int8 or fp8 (e4m3fn bytes) K and V codes with their scales in paged_kv.py's layouts
    (int8 K: one scale per block and channel; the others: one per 32 values of a token's head),
    and values(pool, scale, slots, is_key): the float32 values there, code x scale as the stores read them."""
    slots, group = n_blocks * bs, 32
    if kv_type == "int8":
        k_pool, v_pool = (torch.randint(-127, 128, (slots, Hkv, D), generator=g, dtype=torch.int8) for _ in range(2))
    else:       # every byte but the two NaNs (0x7f, 0xff), which the stores never write
        codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
        k_pool, v_pool = (codes[torch.randint(0, len(codes), (slots, Hkv, D), generator=g)] for _ in range(2))
    k_rows = n_blocks if kv_type == "int8" else slots
    k_scale = torch.rand(k_rows, Hkv, D if kv_type == "int8" else D // group, generator=g) + 0.01
    v_scale = torch.rand(slots, Hkv, D // group, generator=g) + 0.01

    def values(pool, scale, at, is_key):
        codes = pool[at].float() if kv_type == "int8" else pool[at].view(torch.float8_e4m3fn).float()
        if is_key and kv_type == "int8":
            return codes * scale[at // bs]
        return (codes.view(len(at), Hkv, D // group, group) * scale[at][..., None]).view(len(at), Hkv, D)

    return k_pool, v_pool, k_scale, v_scale, values


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, "int8", "fp8"])
def test_the_kernels_read_the_pool_where_the_keys_lie(kind, dtype):
    """The paged ops read a sequence's keys and values in the engine's pool through its blocks
    (shuffled, as a block table holds them) and give the bits of the kernels over the same keys
    gathered into float32 tensors: a causal chunk, a window over keys trimmed to a position that
    is not a block's start, and cascade rows over a shared prefix. Quantized pools (int8, fp8)
    are read as codes times their scales, the values the stores' read gives."""
    from localrun.engine.paged_kv import PoolKeys
    g = torch.Generator().manual_seed(13)
    bs, n_blocks, Hkv, Hq, D = 16, 48, 2, 6, 64
    if isinstance(dtype, str):
        k_pool, v_pool, k_scale, v_scale, values = quantized_pools(dtype, n_blocks, bs, Hkv, D, g)
        scales = (k_scale, v_scale)
    else:
        k_pool, v_pool = (torch.randn(n_blocks * bs, Hkv, D, generator=g).to(dtype) for _ in range(2))
        scales, values = (None, None), lambda pool, scale, at, is_key: pool[at].float()
    order = torch.randperm(n_blocks, generator=g)
    table = order[:20]                                  # one sequence: 320 positions

    def gathered(is_key, blocks, first, n):           # positions first .. first + n - 1 of blocks, float32 (Hkv, n, D)
        p = torch.arange(first, first + n)
        pool, scale = (k_pool, scales[0]) if is_key else (v_pool, scales[1])
        return values(pool, scale, blocks[p // bs] * bs + p % bs, is_key).transpose(0, 1)

    q = torch.randn(20, Hq, D, generator=g)
    keys = PoolKeys(k_pool, v_pool, table, bs, 0, 300, *scales)
    for key0, window in ((0, 0), (150, 100)):          # a causal chunk; a window of 100 over keys from 150 on
        n, offset = 300 - key0, 280 - key0
        got = kernels.attention_paged(kind, q, keys, key0, n, offset, 0.125, window, key0 % 64)
        want = attention(kind)(q, gathered(True, table, key0, n), gathered(False, table, key0, n), offset, 0.125,
                               window, key0 % 64)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), key0
    S, own = 128, [(5, 5), (3, 70), (40, 61)]   # (rows, own keys) of three sequences after 128 shared
    prefix = PoolKeys(k_pool, v_pool, order[:S // bs], bs, 0, S, *scales)
    tables = [torch.cat([order[:S // bs], order[20 + 10 * i:30 + 10 * i]]) for i in range(3)]
    own_keys = [PoolKeys(k_pool, v_pool, t[S // bs:], bs, S, n, *scales) for t, (_, n) in zip(tables, own)]
    qs = torch.randn(sum(t for t, _ in own), Hq, D, generator=g)
    got = kernels.attention_shared_paged(kind, qs, prefix, own_keys, [t for t, _ in own], 0.125)
    want = shared_attention(kind)(qs, gathered(True, order, 0, S), gathered(False, order, 0, S),
                                  [gathered(True, t, S, n) for t, (_, n) in zip(tables, own)],
                                  [gathered(False, t, S, n) for t, (_, n) in zip(tables, own)], [t for t, _ in own], 0.125)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="not in the pool"):
        kernels.attention_paged(kind, q, keys._replace(blocks=table + n_blocks), 0, 300, 280, 0.125)
    with pytest.raises(RuntimeError, match="within the int64 blocks"):
        kernels.attention_paged(kind, q, keys, 0, 330, 310, 0.125)
    if isinstance(dtype, str):
        with pytest.raises(RuntimeError, match="come with their K and V scales"):
            kernels.attention_paged(kind, q, keys._replace(k_scale=None), 0, 300, 280, 0.125)
        with pytest.raises(RuntimeError, match="V scales per group"):
            kernels.attention_paged(kind, q, keys._replace(v_scale=v_scale.repeat(1, 1, 4)), 0, 300, 280, 0.125)


def test_the_f32_kernel_equals_torchs_flash_attention():
    """attention_f32 computes what torch's float32 flash attention computes (the reference path,
    prompt_math "float32"), to float32 summation order: a causal prompt and a chunk after cached keys."""
    if not kernels.has_attention_f32():
        pytest.skip("no AVX2 here (or LOCALRUN_ISA=ref)")
    g = torch.Generator().manual_seed(7)
    for T, L in ((64, 64), (40, 300)):
        q, k, v = torch.randn(T, 4, 64, generator=g), torch.randn(2, L, 64, generator=g), torch.randn(2, L, 64, generator=g)
        out, _ = kernels.attention_f32(q, k, v, L - T, 0.125)
        mask = torch.ones(T, L, dtype=torch.bool).tril(L - T)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(2, 0), v.repeat_interleave(2, 0), attn_mask=mask, scale=0.125)
        torch.testing.assert_close(out, ref.transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_the_model_attends_prompts_through_the_kernel_with_int8_prompt_math_only(tiny_gguf, monkeypatch):
    """A quantized model with prompt_math "int8" (the default) sends every layer's prompt
    attention through this host's kernel (bf16 or f32), and its logits stay within the 8-bit
    activations' error of the float32 path; prompt_math "float32" and float weights never call it."""
    from localrun.api import LLM
    from localrun.model import llama
    kind = kernels.prompt_attention_kind()
    if kind is None:
        pytest.skip("no prompt attention kernel here (LOCALRUN_ISA=ref)")
    calls = []
    name = f"attention_{kind}"
    real = getattr(kernels, name)
    monkeypatch.setattr(llama.kernels, name, lambda *a: calls.append(a[0].shape) or real(*a))
    path = tiny_gguf("Q8_0")
    prompt = list(range(5, 45))
    llm = LLM(path, n_ctx=64)
    fast = llm.logits(prompt).numpy()
    assert len(calls) == len(llm.model.layers) and all(shape[0] == len(prompt) for shape in calls)
    calls.clear()
    exact = LLM(path, n_ctx=64, prompt_math="float32").logits(prompt).numpy()
    LLM(tiny_gguf("F32"), n_ctx=64).logits(prompt)
    assert not calls
    f = fidelity(exact.astype(np.float64), fast, margin=0.2)
    assert f.top1_confident == 1.0 and f.mean_kl < 2e-3, f


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("kv_type", ["f32", "bf16", "f16", "int8", "fp8"])
@pytest.mark.parametrize("block_size,n_kv,D", [(1, 1, 64), (4, 3, 128), (32, 2, 80)])
def test_the_kernels_read_every_store_layout_in_place(kind, kv_type, block_size, n_kv, D):
    """The engine's own stores (paged_kv.PagedKVCache: every KV type, block sizes 1 to 32, one to
    three KV heads, head sizes 64 / 128 / 80, the last with one scale per head) written with a
    sequence's keys through a shuffled table, then read in place by the paged op: the bits of the
    kernel over what the stores' own gather returns (dequantized codes included)."""
    from localrun.engine import paged_kv
    from localrun.engine.paged_kv import PagedKVCache, WriteTarget
    if D % (64 if kind == "bf16" else 16):
        pytest.skip("the bf16 kernel takes head sizes that are multiples of 64")
    if kv_type == "fp8" and paged_kv.fp8_dtype() is None:
        pytest.skip("this torch has no float8_e4m3fn")
    g = torch.Generator().manual_seed(block_size * 100 + n_kv * 10 + D)
    L, T = 150, 9
    n_blocks = (L + block_size - 1) // block_size
    cache = PagedKVCache(num_blocks=n_blocks + 5, block_size=block_size, n_layers=1, n_head_kv=n_kv, head_dim=D,
                         kv_type=kv_type, compute_dtype=torch.float32)
    table = torch.randperm(n_blocks + 5, generator=g)[:n_blocks]
    p = torch.arange(L)
    k, v = torch.randn(L, n_kv, D, generator=g) * 3, torch.randn(L, n_kv, D, generator=g)
    cache.write(0, WriteTarget(table[p // block_size] * block_size + p % block_size, table, 0), k, v)
    k_all, v_all = cache.gather(0, table, L)                     # (n_kv, L, D), float32
    keys = cache.pool_keys(0, table, 0, L)
    q = torch.randn(T, 3 * n_kv, D, generator=g)
    for key0, window in ((0, 0), (37, 50)):
        n, offset = L - key0, L - T - key0
        got = kernels.attention_paged(kind, q, keys, key0, n, offset, 0.125, window, key0 % 64)
        want = attention(kind)(q, k_all[:, key0:], v_all[:, key0:], offset, 0.125, window, key0 % 64)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), key0
