"""The model families beyond llama (qwen2, qwen3, gemma3) on tiny synthetic files: the float64
reference (tests/reference_forward.py) against llama.cpp, localrun against the reference
(prompt and decode paths, several tensor types), sliding-window layers through the paged
engine (decode past the window, prefix-cache hits, batching, speculation), the architecture
table that the loader and the planner share, and the chat template fallbacks."""
from __future__ import annotations

import importlib.util
import random
from collections import deque

import numpy as np
import pytest
import torch

from fidelity import fidelity
from reference_forward import naive_logits
from synthetic_gguf import CHATML_TEMPLATE, write_tiny_llama, write_tiny_model
from layerplan.model_profile import profile_gguf
from localrun.api import LLM
from localrun.chat_template import GEMMA
from localrun.engine.llm_engine import LLMEngine
from localrun.engine.speculative import SpeculativeConfig
from localrun.errors import UserError
from localrun.gguf_file import open_gguf
from localrun.loader import weight_names
from localrun.runner import SequenceRunner
from localrun.sampling import SamplingParams

FAMILIES = ("qwen2", "qwen3", "gemma3")
EOS = 2
requires_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                        reason="llama-cpp-python is not installed")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """tiny(architecture, tensor_type="F32", **options) -> Path, each written once."""
    root, written = tmp_path_factory.mktemp("families"), {}

    def make(architecture, tensor_type="F32", **options):
        key = (architecture, tensor_type, tuple(sorted(options.items())))
        if key not in written:
            written[key] = write_tiny_model(root / f"{architecture}-{len(written)}-{tensor_type}.gguf",
                                            architecture=architecture, tensor_type=tensor_type, **options)
        return written[key]
    return make


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


# --- the architecture table -----------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_loader_and_planner_read_one_description(tiny, family):
    """Every tensor of the file is one the family's description names (none unread, none
    missing), and the planner's sliding-window layers are the model's local layers."""
    f = open_gguf(tiny(family))
    assert set(weight_names(f)) == set(f.tensors)
    profile = profile_gguf(f.path)
    planned = tuple(layer.sliding_window is not None for layer in profile.layers)
    assert planned == (f.config.local_layers or (False,) * f.config.n_layers)
    if family == "gemma3":   # 7 layers, pattern 6: layers 0-4 and 6 local, layer 5 global
        assert planned == (True,) * 5 + (False, True) and f.config.sliding_window == 8
        assert {layer.sliding_window for layer in profile.layers} == {8, None}


def test_missing_family_tensor_is_one_sentence(tiny, tmp_path):
    data = tiny("qwen3").read_bytes().replace(b"blk.1.attn_k_norm.weight", b"blk.1.attn_k_nurm.weight", 1)
    (tmp_path / "bad.gguf").write_bytes(data)
    with pytest.raises(UserError, match="tensor 'blk.1.attn_k_norm.weight' is missing"):
        open_gguf(tmp_path / "bad.gguf")


def test_llama_file_with_a_sliding_window_is_refused_clearly(tmp_path):
    """Mistral v0.1 files are 'llama' with a 4096-token window: localrun would attend over the
    whole context and silently compute another model, so it refuses them in one sentence."""
    path = write_tiny_llama(tmp_path / "mistral.gguf", tensor_type="F32",
                            metadata={"llama.attention.sliding_window": 4096})
    with pytest.raises(UserError, match="sliding window is not supported"):
        open_gguf(path)


# --- numerics: reference vs llama.cpp, localrun vs reference --------------------------------------

@requires_llama_cpp
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tensor_type", ["F32", "Q4_K"])
def test_reference_and_localrun_agree_with_llama_cpp(tiny, family, tensor_type):
    """The reference (and so each family's description) is llama.cpp's model: 24 positions,
    gemma3's crossing its 8-token window. Measured 2026-12-01 (Xeon AVX-512): reference vs
    llama.cpp on F32 files KL <= 3.5e-7, max |diff| <= 0.005, top-1 1.0; on Q4_K files (llama.cpp
    quantizes activations) KL <= 8.5e-4, top-1 1.0 where the margin > 0.2. A local layer given
    the global RoPE base, or no window, moves gemma3's KL past 1e-2."""
    import llama_cpp
    path, prompt = tiny(family, tensor_type), ids(24, seed=1)
    model = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, n_threads=2, verbose=False)
    model.eval(prompt)
    expected = np.array(model.scores[:len(prompt)], dtype=np.float64)
    for name, actual in (("reference", naive_logits(path, prompt)), ("localrun", LLM(path, n_ctx=64).logits(prompt))):
        f = fidelity(expected, np.asarray(actual), margin=0.2)
        assert f.top1_confident == 1.0 and f.mean_kl <= (1e-5 if tensor_type == "F32" else 3e-3), (name, f)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tensor_type", ["F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"])
def test_localrun_equals_the_reference(tiny, family, tensor_type):
    """Prompt logits of the quantized path with float32 prompt activations (prompt_math
    "float32": weights used in place) and of the dequantized float32 path equal the float64
    reference to float32 rounding: 100% top-1. Measured max |diff| <= 7.5e-6."""
    path, prompt = tiny(family, tensor_type), ids(24, seed=2)
    expected = naive_logits(path, prompt)
    for options in ({"prompt_math": "float32"}, {"dtype": "float32"}):
        f = fidelity(expected, LLM(path, n_ctx=64, **options).logits(prompt).numpy())
        assert f.top1 == 1.0 and f.max_abs_diff < 1e-3, (options, f)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q5_0", "Q4_K", "Q6_K"])
def test_int8_prompt_math_is_the_q8_reference_at_every_matmul(tiny, family, tensor_type, monkeypatch):
    """prompt_math "int8" (the default): every product of a prompt forward is the float64 product
    of the activations it was given, rounded to 8-bit blocks as the reference rounds them
    (q8_activations), with the dequantized weight, to float32 rounding. Checked matmul by matmul:
    one activation code that rounds the other way (a 1e-7 change of its input) moves the later
    logits by up to 0.09 on these files (gemma3: at most positions of 24), so the whole forward
    against the int8 reference would compare rounding draws, not the arithmetic. The whole
    forward's error from the exact model stays that of 8-bit activations: measured mean KL
    4e-5-5e-4 and every top-1 with a margin over 0.2."""
    from reference_forward import q8_activations
    from localrun.model.gguf_weight import GGUFWeight
    path, prompt = tiny(family, tensor_type), ids(24, seed=2)
    calls, call = [], GGUFWeight.__call__

    def recording(self, x, decode_rows=0):
        y = call(self, x, decode_rows)
        calls.append((self, x.detach().clone(), y.detach().clone()))
        return y
    monkeypatch.setattr(GGUFWeight, "__call__", recording)
    logits = LLM(path, n_ctx=64).logits(prompt).numpy()
    whole = [x.reshape(-1, w.k).shape[0] == len(prompt) for w, x, _ in calls]
    assert sum(whole) >= 4 * open_gguf(path).config.n_layers        # qkv, wo, gate/up, down: every prompt row
    for w, x, y in calls:
        exact = q8_activations(x.reshape(-1, w.k).numpy()).astype(np.float64) @ w.dequantize().double().numpy().T
        np.testing.assert_allclose(y.reshape(-1, w.n).numpy(), exact, rtol=0, atol=2e-6 * np.abs(exact).max())
    f = fidelity(naive_logits(path, prompt), logits, margin=0.2)
    assert f.top1_confident == 1.0 and f.mean_kl < 2e-3, f


def test_untied_qwen2_head_equals_the_reference(tiny):
    """Qwen 2.5's larger models keep output.weight apart from the embeddings."""
    path, prompt = tiny("qwen2", "Q8_0", tied_output=False), ids(16, seed=7)
    assert "output.weight" in open_gguf(path).tensors
    f = fidelity(naive_logits(path, prompt), LLM(path, n_ctx=64, prompt_math="float32").logits(prompt).numpy())
    assert f.top1 == 1.0 and f.max_abs_diff < 1e-3, f


# --- sliding window through the engine ---------------------------------------------------------------

@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
def test_greedy_decode_follows_the_reference_past_the_window(tiny, family):
    """Greedy generation through the paged engine (the decode rows go through the paged
    attention kernel, local layers with their window) picks the reference's argmax at every
    step, 30 tokens past a 6-token prompt: 4.5 windows."""
    llm = LLM(tiny(family), n_ctx=64)
    prompt = ids(6, seed=3)
    out = llm.generate(prompt, max_tokens=30, temperature=0, ignore_eos=True)
    assert len(out.token_ids) == 30
    full = prompt + out.token_ids
    reference = naive_logits(llm.model_path, full[:-1])[len(prompt) - 1:]          # (30, V)
    regret = reference.max(axis=1) - reference[np.arange(30), out.token_ids]
    assert regret.max() < 1e-3, regret


@pytest.mark.parametrize("family", ["gemma3", "qwen2"])
def test_paged_decode_logits_equal_the_reference_past_the_window(tiny, family):
    """Teacher-forced through the paged pool as the engine runs it: a 5-token prompt chunk, then
    one decode row per step through localrun::paged_attention (local layers pass their window),
    over a shuffled block table, 27 steps: every logit equals the float64 reference to float32
    rounding (measured max |diff| ~1e-5; with the window dropped, 5.5)."""
    from localrun import kernels
    from localrun.engine.paged_kv import PagedKVCache
    from localrun.model.llama import PagedRows, Segment
    llm = LLM(tiny(family), n_ctx=64)
    model, c = llm.model, llm.config
    if not (model.fused and kernels.available()):
        pytest.skip("the paged kernel path needs the compiled kernels")
    bs, table = 4, random.Random(5).sample(range(16), 8)
    cache = PagedKVCache(num_blocks=16, block_size=bs, n_layers=c.n_layers, n_head_kv=c.n_head_kv,
                         head_dim=c.head_dim, kv_type="f32", compute_dtype=torch.float32)
    prompt = ids(32, seed=6)
    out = [model(torch.tensor(prompt[:5]), torch.arange(5), [Segment(0, 5, 0, cache.sequence_view(table))])]
    for p in range(5, len(prompt)):
        rows = PagedRows(1, torch.tensor([table[p // bs] * bs + p % bs]), torch.tensor([table]), torch.tensor([0]),
                         torch.tensor([p + 1]), bs, cache.float_pools)
        out.append(model(torch.tensor([prompt[p]]), torch.tensor([p]), [], decode_rows=1, paged=rows))
    f = fidelity(naive_logits(llm.model_path, prompt), torch.cat(out).numpy())
    assert f.top1 == 1.0 and f.max_abs_diff < 1e-3, f


def test_paged_attention_kernel_window_equals_sliced_sdpa():
    """localrun::paged_attention with window w: each row attends to the last w of its row_len
    positions through a shuffled block table, as torch's SDPA over exactly those keys."""
    from localrun import kernels
    from localrun.model.llama import sdpa
    if not kernels.available():
        pytest.skip("compiled kernels unavailable")
    g = torch.Generator().manual_seed(0)
    H, n_kv, hd, bs, num_blocks, window = 4, 2, 32, 4, 16, 5
    k_pool = torch.randn(num_blocks * bs, n_kv, hd, generator=g)
    v_pool = torch.randn(num_blocks * bs, n_kv, hd, generator=g)
    tables = torch.tensor([random.Random(1).sample(range(num_blocks), 8)], dtype=torch.long)
    lengths = [1, 3, 5, 6, 17, 29]
    q, k, v = (torch.randn(len(lengths), h, hd, generator=g) for h in (H, n_kv, n_kv))
    slots = torch.tensor([tables[0, (n - 1) // bs] * bs + (n - 1) % bs for n in lengths])
    out = torch.ops.localrun.paged_attention(q, k, v, k_pool, v_pool, slots, tables, torch.zeros(len(lengths), dtype=torch.long),
                                             torch.tensor(lengths), bs, window)
    for row, n in enumerate(lengths):
        positions = torch.arange(max(0, n - window), n)
        keys = tables[0, positions // bs] * bs + positions % bs
        expected = sdpa(q[row:row + 1], k_pool[keys].transpose(0, 1), v_pool[keys].transpose(0, 1))
        torch.testing.assert_close(out[row:row + 1], expected, rtol=1e-5, atol=1e-5)


def make_engine(model, shuffle_seed=0, **options):
    engine = LLMEngine(model, tokenizer_eog_ids=(EOS,), **{"num_blocks": 64, "block_size": 4, **options})
    free = list(engine.block_manager.free_block_ids)
    random.Random(shuffle_seed).shuffle(free)
    engine.block_manager.free_block_ids = deque(free)
    return engine


def run_all(engine, prompts, params):
    seqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_used_blocks == 0
    return [s.generated_token_ids for s in seqs]


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SHARED = ids(22, seed=100)          # a shared prefix longer than the 8-token window
PROMPTS = [ids(3, 1), SHARED + ids(2, 2), SHARED + ids(13, 3), ids(26, 4), SHARED[:13]]


@pytest.fixture(scope="module")
def gemma_model(tiny):
    return LLM(tiny("gemma3"), dtype="float32", n_threads=1).model


def solo(model, prompt):
    return list(SequenceRunner(model, model.freqs.shape[0]).generate(list(prompt), GREEDY, frozenset({EOS})))


@pytest.mark.parametrize("prefix_caching, budget", [(True, 16), (False, 16), (True, 128)])
def test_gemma_batching_and_prefix_hits_equal_each_request_alone(gemma_model, prefix_caching, budget):
    """Continuous batching with chunked prefill and prefix-cache hits on prompts that share 22
    tokens (local layers then reuse cached keys older than their window, which they must not
    read) gives each request's tokens as the single-sequence runner gives them alone."""
    engine = make_engine(gemma_model, max_num_seqs=3, max_num_batched_tokens=budget, max_model_len=64,
                         enable_prefix_caching=prefix_caching, enable_chunked_prefill=True)
    outputs = run_all(engine, PROMPTS, GREEDY)
    assert (engine.stats()["prefix_cache_hit_tokens"] > 0) == prefix_caching
    for i, prompt in enumerate(PROMPTS):
        assert outputs[i] == solo(gemma_model, prompt), i


def test_gemma_prefix_hit_on_a_long_prompt_equals_no_cache(gemma_model):
    """The second of two identical 40-token prompts is served 36 tokens from the cache (4.5
    windows) and generates what an engine without a cache generates."""
    prompt = ids(40, seed=9)
    cached = make_engine(gemma_model, max_model_len=64)
    first, second = run_all(cached, [prompt], GREEDY)[0], run_all(cached, [prompt], GREEDY)[0]
    assert cached.stats()["prefix_cache_hit_tokens"] >= 36
    plain = run_all(make_engine(gemma_model, max_model_len=64, enable_prefix_caching=False), [prompt], GREEDY)[0]
    assert first == second == plain


def test_gemma_speculative_greedy_equals_plain(gemma_model):
    """Prompt-lookup speculation (verify rows through the windowed attention) keeps greedy
    output token for token. Repetitive prompts so that drafts are proposed."""
    prompts = [ids(5, 1) * 4, ids(7, 2) * 3]
    plain = run_all(make_engine(gemma_model, max_model_len=64), prompts, GREEDY)
    engine = make_engine(gemma_model, max_model_len=64,
                         speculative=SpeculativeConfig("ngram", num_speculative_tokens=3, adaptive=False))
    assert run_all(engine, prompts, GREEDY) == plain
    assert engine.stats()["spec_draft_tokens"] > 0


# --- chat templates -----------------------------------------------------------------------------

def test_template_less_gemma_falls_back_to_its_turn_format(tiny):
    llm = LLM(tiny("gemma3", chat_template=None), n_ctx=128)
    c = llm.config
    assert c.chat_template_origin == "family" and "no chat template" in c.chat_template_notice
    ids_ = llm.chat_prompt_ids([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    text = llm.tokenizer.decode(ids_, special=True)
    assert text.endswith("<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"), text
    out = llm.chat([{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
    assert out.finish_reason in ("stop", "length")
    assert LLM(tiny("qwen3"), n_ctx=64).config.chat_template_notice is None    # it has ChatML in the file


def test_gemma_template_bad_role_order_is_one_sentence(tiny):
    llm = LLM(tiny("gemma3", chat_template=GEMMA), n_ctx=128)
    assert llm.config.chat_template_origin == "file"
    with pytest.raises(UserError, match="roles must alternate"):
        llm.chat_prompt_ids([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert llm.chat_prompt_ids([{"role": "user", "content": "a"}])


def test_llama_without_template_keeps_chatml(tiny):
    """llama has no family turn format: a template-less llama file still gets the built-in ChatML."""
    path = write_tiny_llama(tiny("qwen2").parent / "llama-no-template.gguf", tensor_type="F32", chat_template=None)
    c = open_gguf(path).config
    assert c.chat_template is None and c.chat_template_origin == "none" and c.chat_template_notice is None
    assert CHATML_TEMPLATE  # the synthetic files' template is ChatML too


def test_server_answers_a_bad_gemma_role_order_with_400_and_stays_healthy(tiny):
    """Gemma's own template raises on two user turns in a row: the server says so in a 400 (not
    a 500) and then serves the next, well-formed request."""
    import httpx
    from localrun.server.app import ServerConfig, create_app
    from server_harness import running
    llm = LLM(tiny("gemma3", chat_template=GEMMA), n_ctx=128)
    with running(create_app(llm, ServerConfig("tiny-gemma"))) as url:
        bad = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "tiny-gemma", "max_tokens": 2,
            "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})
        assert bad.status_code == 400 and "alternate" in bad.json()["error"]["message"], bad.text
        good = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "tiny-gemma", "max_tokens": 2, "messages": [{"role": "user", "content": "a"}]})
        assert good.status_code == 200, good.text


def test_gemma_preemption_under_a_tiny_pool_keeps_every_output(gemma_model):
    """16 global blocks for four sequences of up to 34 tokens: sequences are preempted and
    recomputed (both pools given back and taken again), and every output is still the one the
    sequence gets alone; both pools end empty."""
    # admitted greedily (no output reserve, no watermark), so that the pool runs out and preempts
    engine = make_engine(gemma_model, num_blocks=16, max_model_len=64, max_num_seqs=4, output_reserve_tokens=0,
                         watermark=0.0)
    prompts = [ids(n, seed=50 + n) for n in (10, 14, 18, 12)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["num_preemptions"] >= 1
    for s, prompt in zip(seqs, prompts):
        alone = list(SequenceRunner(gemma_model, gemma_model.freqs.shape[0]).generate(list(prompt), params,
                                                                                      frozenset({EOS})))
        assert s.generated_token_ids == alone, s.request_id
    assert engine.block_manager.num_used_blocks == 0 and engine.block_manager.window.num_used_blocks == 0
