"""localrun's torch model against the naive numpy reference, on tiny synthetic GGUF files of
every supported tensor type, plus the invariants the KV cache and batching must keep."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from localrun.api import LLM
from localrun.model.kv_cache import ContiguousKVCache
from localrun.model.llama import Segment
from reference_forward import compare_logits, naive_logits

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
IDS = [5, 77, 300, 12, 12, 199, 3, 250, 41, 8, 160, 90, 17, 311, 64, 2]


@pytest.mark.parametrize("tensor_type", TYPES)
def test_logits_match_naive_reference(tiny_gguf, tensor_type):
    path = tiny_gguf(tensor_type)
    llm = LLM(path, dtype="float32", n_threads=1)
    got = llm.logits(IDS).numpy()
    expected = naive_logits(path, IDS)
    assert got.shape == (len(IDS), llm.n_vocab) and got.dtype == np.float32
    cmp = compare_logits(expected, got)
    # the same dequantized weights in float32 vs float64: differences are rounding only
    assert cmp.max_abs_diff < 2e-3 * max(1.0, np.abs(expected).max()), cmp
    assert cmp.top1_agreement == 1.0, cmp


def test_logits_of_bad_ids_are_one_clear_error(tiny_gguf):
    """No ids, or an id outside the vocabulary: a UserError naming the fault (no torch error)."""
    from localrun.errors import UserError
    llm = LLM(tiny_gguf("Q8_0"), dtype="float32", n_threads=1)
    with pytest.raises(UserError, match="^logits of no tokens"):
        llm.logits([])
    with pytest.raises(UserError, match="outside the vocabulary"):
        llm.logits([5, llm.n_vocab])


def test_bf16_compute_stays_close(tiny_gguf):
    path = tiny_gguf("Q8_0")
    got = LLM(path, dtype="bfloat16", n_threads=1).logits(IDS).numpy()
    cmp = compare_logits(naive_logits(path, IDS), got)
    assert cmp.mean_kl < 1e-2 and cmp.top1_agreement >= 0.9, cmp


@pytest.mark.parametrize("options", [{"tied_output": False}, {"rope_scaling": {"type": "linear", "factor": 4.0}},
                                     {"n_head": 8, "n_head_kv": 8}, {"n_head": 8, "n_head_kv": 1}])
def test_architecture_variants(tiny_gguf, options):
    path = tiny_gguf("F32", **options)
    got = LLM(path, dtype="float32", n_threads=1).logits(IDS).numpy()
    cmp = compare_logits(naive_logits(path, IDS), got)
    assert cmp.max_abs_diff < 2e-3 and cmp.top1_agreement == 1.0, cmp


def test_incremental_decode_equals_full_forward(tiny_gguf):
    """Prefill in chunks then one token at a time through the KV cache gives the same logits
    as one forward over the whole sequence."""
    llm = LLM(tiny_gguf("F32"), dtype="float32", n_threads=1)
    full = llm.logits(IDS)
    runner = llm.runner
    runner.cached_ids = []
    rows = [runner.forward(IDS[:5], 0, all_logits=True), runner.forward(IDS[5:9], 5, all_logits=True)]
    rows += [runner.forward([t], i, all_logits=True) for i, t in enumerate(IDS[9:], start=9)]
    assert torch.allclose(torch.cat(rows), full, atol=1e-4)


def test_batched_segments_equal_separate_runs(tiny_gguf):
    """Two sequences in one flat batch (one prefilling, one with a cached prefix) give the
    same logits as each run alone: attention never leaks across segments."""
    llm = LLM(tiny_gguf("F32"), dtype="float32", n_threads=1)
    c, model = llm.config, llm.model
    a, b = IDS[:7], IDS[3:15]
    alone_a, alone_b = llm.logits(a), llm.logits(b)

    def cache():
        return ContiguousKVCache(n_layers=c.n_layers, n_head_kv=c.n_head_kv, head_dim=c.head_dim,
                                 max_tokens=64, dtype=torch.float32)
    ca, cb = cache(), cache()
    model(torch.tensor(b[:4]), torch.arange(4), [Segment(0, 4, 0, cb)])        # b's prefix first
    tokens = torch.tensor(a + b[4:])
    positions = torch.cat([torch.arange(len(a)), torch.arange(4, len(b))])
    out = model(tokens, positions, [Segment(0, len(a), 0, ca), Segment(len(a), len(b) - 4, 4, cb)])
    assert torch.allclose(out[:len(a)], alone_a, atol=1e-4)
    assert torch.allclose(out[len(a):], alone_b[4:], atol=1e-4)


def test_greedy_generation_follows_argmax(tiny_gguf):
    """Each greedy token is the argmax of a full forward over everything before it."""
    llm = LLM(tiny_gguf("Q8_0"), dtype="float32", n_threads=1)
    prompt = IDS[:6]
    out = llm.generate(prompt, max_tokens=10, temperature=0, ignore_eos=True)
    assert len(out.token_ids) == 10 and out.finish_reason == "length"
    full = llm.logits(prompt + out.token_ids[:-1])
    assert out.token_ids == full[len(prompt) - 1:].argmax(-1).tolist()


def test_prefix_reuse_across_calls(tiny_gguf):
    """The next call (a chat turn repeating the prompt and the reply) reuses the full KV
    blocks of the first, generated tokens included, and gives the same tokens as a fresh model."""
    llm = LLM(tiny_gguf("F32"), dtype="float32", n_threads=1)
    prompt = (IDS * 3)[:40]
    first = llm.generate(prompt, max_tokens=8, temperature=0, ignore_eos=True)
    follow = prompt + first.token_ids + [9, 10, 11, 12, 13]
    second = llm.generate(follow, max_tokens=4, temperature=0, ignore_eos=True)
    # 40 prompt + 7 fed-back generated tokens have KV: two full 16-token blocks are cached
    assert first.timings["cached_tokens"] == 0
    assert second.timings["cached_tokens"] == 32
    fresh = LLM(tiny_gguf("F32"), dtype="float32", n_threads=1)
    assert fresh.generate(follow, max_tokens=4, temperature=0, ignore_eos=True).token_ids == second.token_ids


def test_batch_of_prompts_equals_one_by_one(tiny_gguf):
    llm = LLM(tiny_gguf("F32"), dtype="float32", n_threads=1)
    prompts = [IDS[:5], IDS[2:14], (IDS * 2)[:27]]
    together = llm.generate(prompts, max_tokens=6, temperature=0, ignore_eos=True)
    llm.reset()
    alone = [llm.generate(p, max_tokens=6, temperature=0, ignore_eos=True).token_ids for p in prompts]
    assert [r.token_ids for r in together] == alone


def test_seeded_sampling_is_reproducible(tiny_gguf):
    llm = LLM(tiny_gguf("F32"), dtype="float32", n_threads=1)
    opts = dict(max_tokens=12, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234, ignore_eos=True)
    a, b = llm.generate(IDS[:5], **opts), llm.generate(IDS[:5], **opts)
    c = llm.generate(IDS[:5], **{**opts, "seed": 99})
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_context_end_stops_generation(tiny_gguf):
    llm = LLM(tiny_gguf("F32"), dtype="float32", n_threads=1, n_ctx=20)
    out = llm.generate(IDS[:15], max_tokens=50, temperature=0, ignore_eos=True)
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_abandoned_stream_frees_its_blocks(tiny_gguf):
    """A consumer that stops reading a stream (Ctrl-C in chat, a client that goes away)
    aborts its request: no KV block stays in use, and the next request runs normally."""
    llm = LLM(tiny_gguf("F32"), dtype="float32", n_threads=1)
    stream = llm.stream((IDS * 3)[:40], max_tokens=50, temperature=0, ignore_eos=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    stats = llm.engine.stats()
    assert stats["num_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
    out = llm.generate(IDS[:6], max_tokens=5, temperature=0, ignore_eos=True)
    assert len(out.token_ids) == 5



@pytest.mark.parametrize("H,n_kv,t,cached", [(4, 4, 3, 5), (6, 2, 40, 70), (8, 1, 130, 300)])
def test_prompt_chunk_after_cached_keys_equals_float64_causal_softmax(H, n_kv, t, cached):
    """A prompt chunk of t queries after `cached` keys, as the prompt path computes it (the
    cached keys and the chunk's own keys in two flash calls, merged by log-sum-exp): query i
    over keys 0..cached + i, as a float64 softmax over exactly those, grouped-query heads."""
    from types import SimpleNamespace
    from localrun.model.llama import Attention
    hd, L = 16, t + cached
    g = torch.Generator().manual_seed(t)
    q = torch.randn(t, H, hd, generator=g)
    k, v = torch.randn(n_kv, L, hd, generator=g), torch.randn(n_kv, L, hd, generator=g)
    layer = SimpleNamespace(n_head=H, n_head_kv=n_kv, head_dim=hd, _kernel=lambda q: False)   # float32 attention
    got = Attention._attend_after_cached(layer, q, k, v)
    assert got.shape == (t, H, hd) and got.dtype == torch.float32
    qd, kd, vd = q.double(), k.double(), v.double()
    for i in range(t):
        for h in range(H):
            kv = h // (H // n_kv)
            s = kd[kv, :cached + i + 1] @ qd[i, h] / hd ** 0.5
            want = torch.softmax(s, 0) @ vd[kv, :cached + i + 1]
            torch.testing.assert_close(got[i, h].double(), want, rtol=0, atol=1e-5)
