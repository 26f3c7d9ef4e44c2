"""localrun against llama.cpp (llama-cpp-python) on the real SmolLM2 GGUF: tokenization is
identical, and teacher-forced next-token predictions agree by the measures of tests/fidelity.py
(mean KL, top-1 where llama.cpp is not near a tie, worst regret). llama.cpp quantizes
activations for its Q4_1 dot products, so exact logit equality is not the target.

The thresholds come from measurements (figures beside each); each was also checked against a
deliberately broken implementation, which every assertion group below fails by a wide margin.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from corpus import FIDELITY_TEXT, TOKENIZER_CASES  # noqa: E402
from fidelity import fidelity  # noqa: E402
from reference_forward import naive_logits  # noqa: E402

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def model_path():
    from localrun.models import DEFAULT_MODEL, pull
    return pull(DEFAULT_MODEL, quiet=True)


@pytest.fixture(scope="module")
def llm(model_path):
    from localrun import LLM
    return LLM(model_path, n_ctx=1024)


@pytest.fixture(scope="module")
def reference(model_path):
    return llama_cpp.Llama(str(model_path), n_ctx=1024, n_batch=512, logits_all=True,
                           n_threads=2, verbose=False)


@pytest.mark.parametrize("add_special", [True, False])
def test_tokenization_identical(llm, reference, add_special):
    for text in TOKENIZER_CASES:
        expected = reference.tokenize(text.encode(), add_bos=add_special, special=True)
        assert llm.tokenize(text, add_special=add_special) == expected, text


def test_detokenize_round_trip(llm):
    for text in TOKENIZER_CASES:
        assert llm.detokenize(llm.tokenize(text, add_special=False)) == text


def test_chat_prompt_has_one_bos(llm):
    """SmolLM2's BOS is <|im_start|>, which its template also writes: it must appear once."""
    ids = llm.chat_prompt_ids([{"role": "user", "content": "Hi"}])
    bos = llm.tokenizer.bos_id
    assert ids[0] == bos and ids[1] != bos
    text = llm.tokenizer.decode(ids, special=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"), text


# SmolLM2 vs llama.cpp, 586 positions of FIDELITY_TEXT, 2026-11-30, Intel Xeon (AVX-512 + VNNI, no
# AMX): mean KL 3.5e-3 (AVX2 kernels forced: 3.4e-3), top-1 0.964 overall, 1.0 over the 418
# positions with a llama.cpp top-2 margin > 0.5, worst regret 0.35 (0.35). Broken on purpose:
# RoPE base 1e4 instead of 1e5 KL 0.25, top-1 (margin > 0.5) 0.89, regret 18.7; RoPE base x1.5
# KL 0.0116, regret 0.65; no 1/sqrt(head_dim) scale KL 4.3, top-1 0.16; K and V swapped KL 11.7,
# top-1 0.002.
LLAMA_CPP_MARGIN = 0.5          # llama.cpp's 8-bit activations move logits by up to ~0.35 at a tie
LLAMA_CPP_MAX_KL = 8e-3
LLAMA_CPP_MIN_TOP1_CONFIDENT = 0.99
LLAMA_CPP_MAX_REGRET = 1.0


def test_teacher_forced_agreement_with_llama_cpp(llm, reference):
    ids = llm.tokenize(FIDELITY_TEXT)
    assert len(ids) >= 500
    reference.reset()
    reference.eval(ids)
    expected = np.asarray(reference.scores[:len(ids)])     # float32; fidelity() widens a slice at a time
    f = fidelity(expected, llm.logits(ids).numpy(), margin=LLAMA_CPP_MARGIN)
    print(f"\nSmolLM2 vs llama.cpp: {f}")
    assert f.mean_kl <= LLAMA_CPP_MAX_KL, f
    assert f.n_confident >= 0.5 * f.n_positions and f.top1_confident >= LLAMA_CPP_MIN_TOP1_CONFIDENT, f
    assert f.worst_regret <= LLAMA_CPP_MAX_REGRET, f


def test_real_model_equals_naive_reference(model_path):
    """On the real file, localrun computes the exact math: the float64 numpy reference agrees
    to float32 rounding (llama.cpp's differences above come from its activation quantization).
    Any top-1 disagreement is then a tie within 2 x max |diff|, so the regret bound follows.
    Measured (48 positions, 2026-11-30, Intel Xeon AVX-512, and with the AVX2 kernels forced):
    max |diff| 1e-4, top-1 1.0. Broken on purpose, max |diff| and worst regret: RoPE base x1.5
    0.70 and 0.007, RoPE base 1e4 4.2 and 1.4, no attention scale 31 and 18, K and V swapped 40
    and 28."""
    from localrun import LLM
    exact = LLM(model_path, n_ctx=64, dtype="float32")
    ids = exact.tokenize(FIDELITY_TEXT)[:48]
    f = fidelity(naive_logits(model_path, ids), exact.logits(ids).numpy())
    assert f.max_abs_diff < 1e-3 and f.worst_regret < 2e-3, f


def test_greedy_text_is_sensible(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France? Answer in one word."}],
                   max_tokens=16, temperature=0)
    assert "Paris" in out.text, out.text
    assert out.finish_reason in ("stop", "length") and out.timings["prompt_tokens"] > 10


def test_stop_string_ends_generation_and_frees_blocks(llm):
    prompt = "List the days of the week, one per line:\n"
    full = llm.generate(prompt, max_tokens=24, temperature=0)
    cut = len(full.text) // 2
    stop = full.text[cut:cut + 4]
    expected = full.text[:full.text.find(stop)]
    out = llm.generate(prompt, max_tokens=24, temperature=0, stop=[stop])
    assert out.text == expected and out.finish_reason == "stop", (full.text, stop, out.text)
    assert len(out.token_ids) < len(full.token_ids)
    assert llm.engine.stats()["num_blocks_used"] == 0


@pytest.fixture(scope="module")
def exact_llm(model_path):
    """Dequantized float32 weights: KV quantization error alone, not mixed with the int4 weight
    kernels' (whose bf16 activations and row-count-dependent rounding add their own noise)."""
    from localrun import LLM
    return LLM(model_path, n_ctx=1024, quantized=False)


# int8 KV vs f16 / bf16 KV, dequantized float32 weights, 586 positions, 2026-11-30, Intel Xeon
# (AVX-512 + VNNI, no AMX): mean KL 1.6e-4 / 1.9e-4, worst regret 0.025 / 0.023; with the AVX2
# kernels forced KL 2.0e-4 / 2.4e-4, regret 0.071 / 0.092. Top-1 0.993-0.995 overall (3-4
# disagreements, all at reference margins <= 0.092), 1.0 over the ~540 positions with a margin
# > 0.1. Zen 4 (issue 14): KL 2.2e-4 vs bf16, top-1 0.9898, which failed the former bar of
# top-1 >= 0.99. Broken on purpose, in the int8 run only: a block's earlier K tokens kept under
# the block's new scale KL 0.052, top-1 (margin > 0.1) 0.96, regret 9.4; K and V swapped KL 11.7,
# top-1 0.002; RoPE base 1e4 KL 0.25, top-1 0.81; no attention scale KL 4.5, top-1 0.13. (int8
# rounding by truncation instead of to nearest, KL 3.8e-4 - 4.5e-4, regret <= 0.13, is too
# subtle for this test across ISAs; the KV store's own tests are the place for it.)
KV_MARGIN = 0.1
KV_MAX_KL = 4e-4
KV_MIN_TOP1_CONFIDENT = 0.99
KV_MAX_REGRET = 0.25


def test_int8_kv_agrees_with_f16_and_bf16_kv(exact_llm):
    """Teacher-forced through the paged cache (two 256-token prefill chunks, then one token at a
    time): int8 KV's next-token distributions follow f16 and bf16 KV's."""
    import torch
    llm = exact_llm

    from localrun.engine.paged_kv import PagedKVCache
    from localrun.model.llama import Segment
    model, c = llm.model, llm.config
    ids = llm.tokenize(FIDELITY_TEXT)
    chunks = [256, 256] + [1] * (len(ids) - 512)

    def teacher_forced(kv_type):
        cache = PagedKVCache(num_blocks=64, block_size=16, n_layers=c.n_layers, n_head_kv=c.n_head_kv,
                             head_dim=c.head_dim, kv_type=kv_type, compute_dtype=model.dtype)
        view = cache.sequence_view(list(range(64))[::-1])
        out, start = [], 0
        for size in chunks:
            chunk = ids[start:start + size]
            out.append(model(torch.tensor(chunk), torch.arange(start, start + size), [Segment(0, size, start, view)]))
            start += size
        return torch.cat(out).numpy()

    int8 = teacher_forced("int8")
    for reference in ("f16", "bf16"):
        f = fidelity(teacher_forced(reference), int8, margin=KV_MARGIN)
        print(f"\nint8 vs {reference} KV: {f}")
        assert f.mean_kl <= KV_MAX_KL, (reference, f)
        assert f.top1_confident >= KV_MIN_TOP1_CONFIDENT, (reference, f)
        assert f.worst_regret <= KV_MAX_REGRET, (reference, f)
