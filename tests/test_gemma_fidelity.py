"""localrun against llama.cpp on the real gemma-3-270m (Q4_K_M: Q5_0, Q4_K, Q6_K and Q8_0
tensors; 15 of 18 layers with a 512-token sliding window): tokenization of the 262k
SentencePiece vocabulary, teacher-forced next-token predictions by the measures of
tests/fidelity.py and the thresholds the suite holds SmolLM2 to (tests/test_fidelity.py), over a
text twice the window, and greedy text up to the first near-tie."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from corpus import CODE, FIDELITY_TEXT, PROSE, PROSE_2, TOKENIZER_CASES  # noqa: E402
from fidelity import fidelity  # noqa: E402
from reference_forward import naive_logits  # noqa: E402
from test_fidelity import (LLAMA_CPP_MARGIN, LLAMA_CPP_MAX_KL, LLAMA_CPP_MAX_REGRET,  # noqa: E402
                           LLAMA_CPP_MIN_TOP1_CONFIDENT)

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.model

LONG_TEXT = FIDELITY_TEXT + PROSE_2 + CODE + PROSE      # 793 tokens: 1.5 windows
WINDOW = 512


@pytest.fixture(scope="module")
def model_path():
    from localrun.models import pull
    return pull("gemma3-270m", quiet=True)


@pytest.fixture(scope="module")
def llm(model_path):
    from localrun import LLM
    return LLM(model_path, n_ctx=1024)


@pytest.fixture(scope="module")
def reference(model_path):
    return llama_cpp.Llama(str(model_path), n_ctx=1024, n_batch=512, logits_all=True, n_threads=2, verbose=False)


def test_tokenization_identical(llm, reference):
    for text in TOKENIZER_CASES + [LONG_TEXT]:
        expected = reference.tokenize(text.encode(), add_bos=True, special=True)
        assert llm.tokenize(text) == expected, text[:60]


# gemma-3-270m vs llama.cpp, 793 positions of LONG_TEXT, 2026-12-01, Intel Xeon (AVX-512 + VNNI):
# all positions mean KL 4.8e-3, top-1 where llama.cpp's margin > 0.5 1.0 (of 644), worst regret
# 0.41; the 281 positions past the window KL 9.1e-4, top-1 (margin > 0.5) 1.0, regret 0.003.
# localrun's own float32 logits equal the float64 reference to 4e-5 (below): the KL is
# llama.cpp's 8-bit activations. Broken on purpose: local layers over the whole context (no
# window), past the window KL 3.8, top-1 (margin > 0.5) 0.42, regret 30; local layers with the
# global RoPE base (538 positions) KL 2.3, top-1 (margin > 0.5) 0.34, regret 15.
def test_teacher_forced_agreement_with_llama_cpp(llm, reference):
    ids = llm.tokenize(LONG_TEXT)
    assert len(ids) > WINDOW + 250
    reference.reset()
    reference.eval(ids)
    expected = np.asarray(reference.scores[:len(ids)])     # float32; fidelity() widens a slice at a time
    actual = llm.logits(ids).numpy()
    for name, rows in (("all positions", slice(None)), ("past the window", slice(WINDOW, None))):
        f = fidelity(expected[rows], actual[rows], margin=LLAMA_CPP_MARGIN)
        print(f"\ngemma-3-270m vs llama.cpp, {name}: {f}")
        assert f.mean_kl <= LLAMA_CPP_MAX_KL, (name, f)
        assert f.n_confident >= 0.5 * f.n_positions and f.top1_confident >= LLAMA_CPP_MIN_TOP1_CONFIDENT, (name, f)
        assert f.worst_regret <= LLAMA_CPP_MAX_REGRET, (name, f)


def test_real_model_equals_naive_reference(model_path):
    """localrun's dequantized float32 path is the exact math of the float64 reference (48
    positions; measured max |diff| 3.7e-5)."""
    from localrun import LLM
    exact = LLM(model_path, n_ctx=64, dtype="float32")
    ids = exact.tokenize(FIDELITY_TEXT)[:48]
    f = fidelity(naive_logits(model_path, ids), exact.logits(ids).numpy())
    assert f.max_abs_diff < 1e-3 and f.worst_regret < 2e-3, f


@pytest.mark.parametrize("prompt", ["def fibonacci(n):", "Once upon a time, a small fox", "The capital of France is"])
def test_greedy_text_equals_llama_cpp_up_to_a_near_tie(llm, reference, prompt):
    """Greedy generation (paged engine, decode kernels) gives llama.cpp's tokens; where the two
    part, llama.cpp itself was at a near-tie (its logits of the two tokens within
    LLAMA_CPP_MAX_REGRET), never a real disagreement. Measured: the first two prompts equal for
    24 tokens; the third parts after a dozen tokens at a 0.2-logit tie (' largest' / ' capital')
    where llama.cpp's own one-token and batched evaluations disagree too."""
    ids = llm.tokenize(prompt)
    reference.reset()
    expected = []
    for token in reference.generate(ids, temp=0, top_k=1):
        expected.append(token)
        if len(expected) == 24:
            break
    actual = llm.generate(prompt, max_tokens=24, temperature=0, ignore_eos=True).token_ids
    same = next((i for i, (a, b) in enumerate(zip(expected, actual)) if a != b), 24)
    if same < 24:
        reference.reset()
        reference.eval(ids + expected[:same])
        scores = np.array(reference.scores[len(ids) + same - 1])
        gap = scores[expected[same]] - scores[actual[same]]
        assert gap <= LLAMA_CPP_MAX_REGRET, (same, gap, llm.detokenize(expected), llm.detokenize(actual))
    assert same >= 8, (llm.detokenize(expected), llm.detokenize(actual))


def test_chat_without_a_template_uses_gemma_turns_and_answers(llm):
    assert "no chat template" in llm.config.chat_template_notice
    ids = llm.chat_prompt_ids([{"role": "system", "content": "Answer briefly."},
                               {"role": "user", "content": "Name a colour."}])
    assert llm.tokenizer.decode(ids, special=True) == (
        "<bos><start_of_turn>user\nAnswer briefly.\n\nName a colour.<end_of_turn>\n<start_of_turn>model\n")
    out = llm.chat([{"role": "user", "content": "Name a colour."}], max_tokens=8, temperature=0)
    assert out.text and out.finish_reason in ("stop", "length")
