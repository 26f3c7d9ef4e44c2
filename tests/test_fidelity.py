"""localrun against llama.cpp (llama-cpp-python) on the real SmolLM2 GGUF: tokenization is
identical, and teacher-forced next-token predictions agree (top-1 >= 95%, mean KL <= 0.01).
llama.cpp quantizes activations for its Q4_1 dot products, so exact logit equality is not
the target; agreement and KL are."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from corpus import FIDELITY_TEXT, TOKENIZER_CASES  # noqa: E402
from reference_forward import compare_logits, naive_logits  # noqa: E402

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


def test_teacher_forced_agreement_with_llama_cpp(llm, reference):
    ids = llm.tokenize(FIDELITY_TEXT)
    assert len(ids) >= 500
    reference.reset()
    reference.eval(ids)
    expected = np.array(reference.scores[:len(ids)], dtype=np.float64)
    got = llm.logits(ids).numpy()
    cmp = compare_logits(expected, got)
    print(f"\nSmolLM2 vs llama.cpp over {len(ids)} positions: top-1 {cmp.top1_agreement:.3f}, "
          f"mean KL {cmp.mean_kl:.4f}, max |diff| {cmp.max_abs_diff:.2f}")
    assert cmp.top1_agreement >= 0.95, cmp
    assert cmp.mean_kl <= 0.01, cmp


def test_real_model_equals_naive_reference(model_path):
    """On the real file, localrun computes the exact math: the float64 numpy reference agrees
    to float32 rounding (llama.cpp's differences above come from its activation quantization)."""
    from localrun import LLM
    exact = LLM(model_path, n_ctx=64, dtype="float32")
    ids = exact.tokenize(FIDELITY_TEXT)[:48]
    cmp = compare_logits(naive_logits(model_path, ids), exact.logits(ids).numpy())
    assert cmp.top1_agreement == 1.0 and cmp.max_abs_diff < 1e-3, cmp


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


def test_int8_kv_agrees_with_f16_and_bf16_kv(exact_llm):
    """Teacher-forced through the paged cache (two 256-token prefill chunks, then one token at a
    time): int8 KV's next-token top-1 agreement with f16 and bf16 KV is at least 99%."""
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
        cmp = compare_logits(teacher_forced(reference), int8)
        print(f"\nint8 vs {reference} KV over {len(ids)} positions: top-1 {cmp.top1_agreement:.4f}, KL {cmp.mean_kl:.2e}")
        assert cmp.top1_agreement >= 0.99, (reference, cmp)
