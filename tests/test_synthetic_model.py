"""benchmarks/synthetic_model.py: llamas of random blocks in llama.cpp's quantization mixes, which
localrun and llama.cpp must compute alike for the benchmarks that time them to mean anything."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from fidelity import fidelity
from localrun.api import LLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from synthetic_model import SYNTHETIC, Shape, more_bits, write_llama  # noqa: E402

requires_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                        reason="llama-cpp-python is not installed")


def tensor_types(path: Path) -> dict[str, str]:
    import gguf
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def test_q4_k_m_mix_is_llama_cpps():
    """llama.cpp's Q4_K_M: Q6_K for the head, and for attn_v and ffn_down in the first and last
    eighth of the layers and every third between (TinyLlama-1.1B's 22 layers: 0, 1, 4, 7, 10, 13,
    16, 19, 20, 21, hand-listed from llama.cpp's use_more_bits); Q4_K for every other matrix."""
    assert [i for i in range(22) if more_bits(i, 22)] == [0, 1, 4, 7, 10, 13, 16, 19, 20, 21]
    assert SYNTHETIC["synthetic-1b-q4_k_m"].n_layers == 22


def test_written_types_follow_the_mix(tmp_path):
    shape = Shape(n_layers=16, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_vocab=320, mix="q4_k_m")
    types = tensor_types(write_llama(tmp_path / "m.gguf", shape))
    six = {i for i in range(16) if more_bits(i, 16)}
    assert six == {0, 1, 4, 7, 10, 13, 14, 15}
    for i in range(16):
        for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert types[f"blk.{i}.{name}.weight"] == "Q4_K"
        for name in ("attn_v", "ffn_down"):
            assert types[f"blk.{i}.{name}.weight"] == ("Q6_K" if i in six else "Q4_K")
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    q4_0 = tensor_types(write_llama(tmp_path / "q.gguf", Shape(2, 256, 512, 4, 2, 320, "q4_0")))
    assert {t for n, t in q4_0.items() if not n.endswith("norm.weight")} == {"Q4_0"} and "output.weight" not in q4_0


@requires_llama_cpp
@pytest.mark.parametrize("mix", ["q4_k_m", "q4_0"])
def test_localrun_computes_what_llama_cpp_computes(tmp_path, mix):
    """Prompt rows (one call of 24) and decode rows (one at a time: the one-row K-quant kernel)
    against llama.cpp on the same file. The random weights give logits of standard deviation
    ~1 (the scales are set for it), so near-ties are common: top-1 where llama.cpp's margin is
    over 0.2, and the mean KL, as tests/test_families.py judges a quantized file. Measured
    2026-12-05 (Zen 4): last position max |diff| 0.017 (Q4_K_M) and 0.006 (Q4_0), logit std 1.01."""
    import llama_cpp

    path = write_llama(tmp_path / f"{mix}.gguf", Shape(n_layers=4, n_embd=512, n_ff=1024, n_head=8, n_head_kv=2,
                                                        n_vocab=512, mix=mix))
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 512, 24)]
    ref = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, n_threads=2, verbose=False)
    ref.eval(prompt)
    expected = np.array(ref.scores[:len(prompt)], dtype=np.float64)
    assert expected.std() > 0.5                        # the scales give logits that say something
    llm = LLM(path, n_ctx=64)
    prompt_rows = llm.logits(prompt).numpy()
    runner = llm.runner
    decode_rows = np.concatenate([runner.forward(prompt[:8], 0, all_logits=True).numpy()]
                                 + [runner.forward([t], i, all_logits=True).numpy()
                                    for i, t in enumerate(prompt[8:], start=8)])
    for name, got in (("prompt rows", prompt_rows), ("decode rows", decode_rows)):
        f = fidelity(expected, got.astype(np.float64), margin=0.2)
        assert f.top1_confident == 1.0 and f.mean_kl <= 3e-3, (name, f)
