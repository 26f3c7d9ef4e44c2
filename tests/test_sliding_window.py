"""The sliding-window layers' KV pool: blocks out of the window are given back (counted), a
prefix hit is used only as far as the local window is cached, rollback and preemption free
what they should, and the engine's pools match what layerplan plans per layer type."""
from __future__ import annotations

import math
import random

import pytest
import torch

from layerplan.kv_cache import kv_type as planner_kv_type, layer_kv_bytes, num_window_blocks
from layerplan.model_profile import profile_gguf
from localrun.api import LLM
from localrun.engine.block_manager import BlockManager
from localrun.engine.llm_engine import LLMEngine
from localrun.engine.sequence import Sequence
from localrun.engine.window_blocks import FREED, WindowBlocks
from localrun.sampling import SamplingParams
from synthetic_gguf import write_tiny_model

BS, WINDOW = 4, 8


def seq(request_id: str, token_ids: list[int]) -> Sequence:
    return Sequence(request_id, list(token_ids))


def test_blocks_out_of_the_window_are_given_back():
    """A sequence computing 40 tokens one at a time holds at most ceil((w-1)/bs) + 1 local blocks
    (7 tokens back plus the current one: 3 blocks of 4), while its global table grows to 10."""
    bm = BlockManager(num_blocks=32, block_size=BS, enable_prefix_caching=False, num_local_blocks=8,
                      sliding_window=WINDOW)
    s = seq("a", list(range(100, 101)))
    bm.allocate(s, 1)
    held = []
    for step in range(40):
        s.num_computed_tokens += 1
        bm.cache_full_blocks(s)
        held.append(bm.window.num_held_blocks("a"))
        s.append_token(200 + step)
        assert bm.can_append_slots(s, 1)
        bm.append_slots(s, 1)
    assert len(s.block_table) == 11 and max(held) <= math.ceil((WINDOW - 1) / BS) + 1 == 3
    table = bm.local_block_table(s)
    assert table[:7].count(FREED) == 7 and FREED not in table[-2:]
    assert bm.window.num_used_blocks == bm.window.num_held_blocks("a") <= 3
    bm.deallocate(s)
    assert bm.window.num_used_blocks == 0 and bm.num_used_blocks == 0


def test_a_prefix_hit_needs_its_window_in_the_local_pool():
    """Six global blocks of a prefix are cached. A query at position 4n reads keys from 4n - 7
    on, so n blocks are usable when local blocks (4n - 7) // 4 .. n-1 are cached: with blocks
    2..5 cached all six are; with 5 evicted, five (blocks 3, 4); with an empty pool, none."""
    w = WindowBlocks(num_blocks=16, block_size=BS, sliding_window=WINDOW)
    hashes = [bytes([i]) * 4 for i in range(6)]
    tokens = lambda i: (i,)   # noqa: E731
    for i in (2, 3, 4, 5):
        w.block_hash[i], w.token_ids[i], w.cached_block_ids[hashes[i]] = hashes[i], (i,), i
        w.free_block_ids.remove(i)
        w.evictable_block_ids[i] = None
    assert w.usable_prefix(hashes, tokens) == 6
    assert w.usable_prefix(hashes, lambda i: (i + 1,)) == 0      # same hashes, other tokens: a collision
    del w.cached_block_ids[hashes[5]]
    assert w.usable_prefix(hashes, tokens) == 5
    assert WindowBlocks(16, BS, WINDOW).usable_prefix(hashes, tokens) == 0


def test_rollback_frees_the_local_blocks_of_rejected_drafts():
    bm = BlockManager(num_blocks=32, block_size=BS, num_local_blocks=16, sliding_window=WINDOW)
    s = seq("a", list(range(10)))
    bm.allocate(s, 10)
    s.num_computed_tokens = 10
    bm.cache_full_blocks(s)
    for t in range(6):                        # six drafted tokens, verified in one step
        s.append_token(50 + t)
    bm.append_slots(s, 6)
    assert len(bm.local_block_table(s)) == 4
    bm.rollback(s, 5)                         # five rejected: 11 tokens remain
    assert len(bm.local_block_table(s)) == 3 == len(s.block_table)
    bm.deallocate(s)
    assert bm.window.num_used_blocks == 0


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("swa") / "gemma.gguf", architecture="gemma3")
    return LLM(path, dtype="float32", n_threads=1)


def test_engine_generation_holds_the_window_only(gemma):
    """A 20-token prompt plus 40 generated tokens through the engine: the sequence ends with 15
    global blocks and at most 3 local ones in use (8-token window, 4-token blocks)."""
    engine = LLMEngine(gemma.model, tokenizer_eog_ids=(2,), num_blocks=64, block_size=BS, max_model_len=64,
                       max_num_seqs=1, max_num_batched_tokens=16)
    s = engine.add_request("a", [random.Random(0).randrange(3, 320) for _ in range(20)],
                           SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    peak_local = 0
    while engine.has_unfinished():
        engine.step()
        if engine.has_unfinished():
            peak_local = max(peak_local, engine.block_manager.window.num_held_blocks("a"))
            assert len(s.block_table) == -(-s.num_computed_tokens // BS) or s.num_computed_tokens < 20
    assert len(s.generated_token_ids) == 40
    assert peak_local <= math.ceil((WINDOW - 1) / BS) + 1 + 16 // BS     # window + one 16-token prefill chunk
    assert engine.block_manager.window.num_used_blocks == 0


def test_engine_pools_match_the_plan_per_layer_type(gemma):
    """Global layers: the pool holds max_num_seqs x max_model_len tokens, the planner's figure
    exactly. Local layers: the planner's n_parallel x min(n_ctx, window) plus what a step adds
    (a partly filled block each side of every window, and one step's new tokens), as
    llama.cpp's SWA cache adds its ubatch."""
    n_ctx, n_parallel, batched = 64, 3, 16
    engine = LLMEngine(gemma.model, tokenizer_eog_ids=(2,), block_size=BS, max_model_len=n_ctx,
                       max_num_seqs=n_parallel, max_num_batched_tokens=batched, kv_type="f32",
                       kv_budget_bytes=1 << 30)
    profile = profile_gguf(gemma.model_path)
    f32 = planner_kv_type("f32")
    planned = {kind: sum(layer_kv_bytes(layer, f32, n_ctx, n_parallel) for layer in profile.layers
                         if (layer.sliding_window is not None) == (kind == "local")) for kind in ("global", "local")}
    cache = engine.kv_cache
    pool = {"global": 0, "local": 0}
    for layer, (k, v) in enumerate(cache.layers):
        pool["local" if cache.is_local(layer) else "global"] += sum(t.numel() * t.element_size()
                                                                  for t in k.tensors() + v.tensors())
    assert pool["global"] == planned["global"]
    n_local = gemma.config.num_local_layers
    per_token = planned["local"] / (n_local and n_parallel * min(n_ctx, WINDOW))   # bytes per token of all local layers
    extra_tokens = n_parallel * 2 * BS + batched + n_parallel * (BS - (WINDOW - 1) % BS - 1)
    assert planned["local"] <= pool["local"] <= planned["local"] + extra_tokens * per_token
    assert engine.num_local_blocks == num_window_blocks(WINDOW, BS, n_parallel, batched)


@pytest.mark.parametrize("n_ctx", [64, 32])
def test_the_ledger_counts_the_local_pool_the_engine_allocates(gemma, n_ctx):
    """The engine ledger's KV line: the global layers' pool, and of the local layers' pool what
    filled contexts commit (blocks leaving a window stay cached until the pool runs out): the
    whole pool when n_parallel x n_ctx reaches it (64: 3 x 64 tokens, a pool of 3 x 3 + 1
    blocks of 16), n_parallel x n_ctx tokens when it does not (32: 96 of its 160)."""
    import layerplan
    from layerplan.ledger import EngineOptions, engine_ledger
    from layerplan.probe import probe_host
    n_parallel, batched, bs = 3, 16, 16
    engine = LLMEngine(gemma.model, tokenizer_eog_ids=(2,), block_size=bs, max_model_len=n_ctx,
                       max_num_seqs=n_parallel, max_num_batched_tokens=batched, kv_type="f32", kv_budget_bytes=1 << 30)
    plan = layerplan.plan(profile_gguf(gemma.model_path), layerplan.Machine(gpus=(), host=probe_host()), n_ctx=n_ctx,
                          n_parallel=n_parallel, kv_type="f32", n_gpu_layers=0, with_sweep=False, n_ubatch=batched)
    (planned,) = [i.n_bytes for i in engine_ledger(plan, EngineOptions(kv_type="f32")).items
                  if i.what.startswith("KV pool")]
    cache, c = engine.kv_cache, gemma.model.config
    pool = {"global": 0, "local": 0}
    for layer, (k, v) in enumerate(cache.layers):
        pool["local" if cache.is_local(layer) else "global"] += sum(t.numel() * t.element_size()
                                                                  for t in k.tensors() + v.tensors())
    assert engine.num_local_blocks * bs == 160
    local_per_token = c.num_local_layers * 2 * c.n_head_kv * c.head_dim * 4
    assert pool["local"] == 160 * local_per_token
    assert planned == pool["global"] + min(n_parallel * n_ctx, 160) * local_per_token


@pytest.mark.parametrize("kv_type", ["int8", "fp8"])
def test_quantized_kv_of_a_windowed_model_through_the_paged_kernel(tmp_path, kv_type, monkeypatch):
    """gemma-3's local layers keep their own pool: int8/fp8 decode rows are quantized into it
    (and into the global pool) by the paged kernel, which reads both in place: the same greedy
    outputs as the stores' writes + gather path, for three sequences past the 8-token window."""
    from localrun import kernels
    from localrun.engine import paged_kv
    if kv_type == "fp8" and paged_kv.fp8_dtype() is None:
        pytest.skip("this torch has no float8_e4m3fn")
    if not kernels.available():
        pytest.skip("localrun's kernels did not compile here")
    path = write_tiny_model(tmp_path / "gemma-q8.gguf", architecture="gemma3", tensor_type="Q8_0")
    model = LLM(path, dtype="float32", quantized=True, n_threads=1).model
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (5, 11, 20)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    def generate(paged_kernel: bool) -> list[list[int]]:
        monkeypatch.setattr(paged_kv.PagedKVCache, "supports_paged_attention",
                            property(lambda self: paged_kernel))
        engine = LLMEngine(model, tokenizer_eog_ids=(2,), num_blocks=64, block_size=BS, max_model_len=64,
                           max_num_seqs=3, max_num_batched_tokens=16, kv_type=kv_type)
        assert engine.kv_cache.local_layers and engine.kv_cache.quantized
        seqs = [engine.add_request(str(i), p, params) for i, p in enumerate(prompts)]
        while engine.has_unfinished():
            engine.step()
        return [s.generated_token_ids for s in seqs]

    calls = []
    real = torch.ops.localrun.decode_layers           # every block of a decode step in one call, with every layer's scales
    monkeypatch.setattr(torch.ops.localrun, "decode_layers",
                        lambda *a, **k: calls.append(len(a[-1]) == len(model.layers)) or real(*a, **k))
    with_kernel = generate(True)
    assert calls and all(calls)
    assert with_kernel == generate(False)


@pytest.mark.parametrize("t,offset,window", [(5, 0, 8), (40, 20, 64), (700, 0, 64), (600, 37, 100), (513, 900, 512),
                                              (300, 10, 3)])
def test_windowed_prompt_attention_equals_float64_masked_softmax(t, offset, window):
    """A prompt chunk of t queries (positions P-t..P-1) in a sliding-window layer, its queries in
    blocks of WINDOW_QUERY_BLOCK, each over its own window of keys: the same as a float64 softmax
    over exactly the keys p with P-t+i - window < p <= P-t+i, for chunks of one block and of
    several, with and without keys cached before them (k_all holds positions offset..P-1); and
    chunks whose every query sees every key held (5 in a window of 8; 40 after 20 cached, window
    64), which take plain causal attention."""
    from types import SimpleNamespace
    from localrun.model.llama import Attention
    g = torch.Generator().manual_seed(t + offset)
    H, n_kv, hd, L = 4, 2, 16, t + min(offset, 2 * window)
    q = torch.randn(t, H, hd, generator=g)
    k, v = torch.randn(n_kv, L, hd, generator=g), torch.randn(n_kv, L, hd, generator=g)
    layer = SimpleNamespace(window=window, n_head=H, n_head_kv=n_kv, _kernel=lambda q: False)   # float32 attention
    layer._attend_causal = lambda *a, **kw: Attention._attend_causal(layer, *a, **kw)
    layer._attend_after_cached = lambda *a: Attention._attend_after_cached(layer, *a)
    got = Attention._attend_window(layer, q, k, v, rowwise=False, offset=offset)
    P = offset + L
    qd, kd, vd = q.double(), k.double(), v.double()
    for i in range(t):
        p = P - t + i
        keys = [j for j in range(L) if p - window < offset + j <= p]
        for h in range(H):
            kv = h // (H // n_kv)
            s = kd[kv, keys] @ qd[i, h] / hd ** 0.5
            want = torch.softmax(s, 0) @ vd[kv, keys]
            torch.testing.assert_close(got[i, h].double(), want, rtol=0, atol=1e-5)
