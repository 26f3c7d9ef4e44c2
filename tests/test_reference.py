"""Tests of the test fixtures: the synthetic GGUF writer and the naive reference forward pass.

The reference is checked three ways: against a hand-composed single-token forward pass, against
HF's rotate_half RoPE (through the converter's Q/K permutation), and, when llama-cpp-python is
installed, against llama.cpp's own logits on the same synthetic files.
"""

from __future__ import annotations

import importlib.util

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from fidelity import fidelity
from reference_forward import (
    LlamaHyperparams,
    attention,
    naive_logits,
    read_llama_gguf,
    rope_adjacent_pairs,
)
from synthetic_gguf import TENSOR_TYPES, tiny_bpe_vocab, tiny_llama_weights

SHAPES = dict(n_layers=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=320)  # write_tiny_llama's defaults

# Relative (Frobenius) error of dequantized vs generated weights; measured 0.086 for Q4_0,
# 0.078 Q4_1/Q4_K, 0.043 Q5_0, 0.038 Q5_1/Q5_K, 0.019 Q6_K, 0.0054 Q8_0.
MAX_RELATIVE_ERROR = {
    QType.F32: 0.0, QType.F16: 1e-3, QType.BF16: 5e-3, QType.Q8_0: 1e-2, QType.Q6_K: 3e-2,
    QType.Q5_0: 6e-2, QType.Q5_1: 6e-2, QType.Q5_K: 6e-2, QType.Q4_0: 0.12, QType.Q4_1: 0.12, QType.Q4_K: 0.12,
}

requires_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed"
)


def _token_ids(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, SHAPES["n_vocab"], n).tolist()


# --------------------------------------------------------------------------------------------
# The writer


@pytest.mark.parametrize("tensor_type", TENSOR_TYPES, ids=lambda t: t.name)
def test_every_tensor_type_round_trips(tiny_gguf, tensor_type):
    generated = tiny_llama_weights(**SHAPES, tied_output=True, seed=0)
    reader = gguf.GGUFReader(tiny_gguf(tensor_type))
    assert {t.name for t in reader.tensors} == set(generated)
    for tensor in reader.tensors:
        expected = generated[tensor.name]
        assert [int(n) for n in tensor.shape] == list(reversed(expected.shape)), tensor.name
        assert tensor.tensor_type == (QType.F32 if expected.ndim == 1 else tensor_type), tensor.name
        got = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(expected.shape)
        assert np.isfinite(got).all(), tensor.name
        if tensor.tensor_type == QType.F32:
            np.testing.assert_array_equal(got, expected, err_msg=tensor.name)
        relative_error = np.linalg.norm(got - expected) / np.linalg.norm(expected)
        assert relative_error <= MAX_RELATIVE_ERROR[tensor.tensor_type], (tensor.name, relative_error)
        assert 0.9 < np.std(got) / np.std(expected) < 1.1, tensor.name


def test_k_quant_blocks_use_the_hard_bits(tiny_gguf):
    """The K-quant fixtures exercise what naive dequantizers get wrong: high bits of the 6-bit
    sub-scales and mins, Q5_K's fifth bit, and Q6_K's negative int8 scales."""
    for tensor_type in (QType.Q4_K, QType.Q5_K):
        blocks = _blocks_of(tiny_gguf(tensor_type), tensor_type)
        scales, mins = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
        assert scales.max() >= 32 and mins.max() >= 32
        assert (scales[:, 4:] >= 16).any() and (mins[:, 4:] >= 16).any()  # bits packed into bytes 0-7
    q5_high_bits = _blocks_of(tiny_gguf(QType.Q5_K), QType.Q5_K)[:, 16:48]
    assert q5_high_bits.any() and not (q5_high_bits == 0xFF).all()
    q6_scales = _blocks_of(tiny_gguf(QType.Q6_K), QType.Q6_K)[:, 192:208].view(np.int8)
    assert (q6_scales < 0).any() and (q6_scales > 0).any()


def _blocks_of(path, tensor_type: QType) -> np.ndarray:
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_down.weight")
    assert tensor.tensor_type == tensor_type
    return tensor.data.reshape(-1, gguf.GGML_QUANT_SIZES[tensor_type][1])


def test_metadata_is_what_llama_cpp_reads(tiny_gguf):
    reader = gguf.GGUFReader(tiny_gguf("Q4_K", tied_output=False, rope_scaling={"type": "linear", "factor": 4.0}))
    fields = {key: field.contents() for key, field in reader.fields.items()}
    assert fields["general.architecture"] == "llama"
    assert fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_K_M
    assert fields["llama.block_count"] == 2 and fields["llama.context_length"] == 256
    assert fields["llama.embedding_length"] == 256 and fields["llama.feed_forward_length"] == 512
    assert fields["llama.attention.head_count"] == 4 and fields["llama.attention.head_count_kv"] == 2
    assert fields["llama.rope.dimension_count"] == 64 and fields["llama.rope.freq_base"] == 10000.0
    assert fields["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert fields["llama.rope.scaling.type"] == "linear" and fields["llama.rope.scaling.factor"] == 4.0
    assert fields["tokenizer.ggml.model"] == "gpt2" and "<|im_start|>" in fields["tokenizer.chat_template"]
    assert len(fields["tokenizer.ggml.tokens"]) == len(fields["tokenizer.ggml.token_type"]) == 320
    names = {t.name for t in reader.tensors}
    assert "output.weight" in names
    assert "output.weight" not in {t.name for t in gguf.GGUFReader(tiny_gguf("F32")).tensors}


def test_tokenizer_vocabulary_is_consistent():
    tokens, token_types, merges = tiny_bpe_vocab(320)
    assert len(tokens) == len(set(tokens)) == len(token_types) == 320
    assert tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] and token_types[:3] == [3, 3, 3]
    assert tokens[3 + ord(" ")] == "Ġ" and tokens[3 + ord("\n")] == "Ċ"
    for merge in merges:  # every merge spells a token, from tokens
        left, right = merge.split(" ")
        assert left in tokens and right in tokens and left + right in tokens
    assert "Ġthe" in tokens


# --------------------------------------------------------------------------------------------
# The reference forward pass


def test_reference_matches_a_hand_composed_single_token_forward(tiny_gguf):
    """T=1: attention reduces to v (softmax over one key), RoPE at position 0 is the identity."""
    w = {k: v.astype(np.float64) for k, v in tiny_llama_weights(**SHAPES, tied_output=True, seed=0).items()}
    token = 42
    x = w["token_embd.weight"][token]
    group = SHAPES["n_head"] // SHAPES["n_head_kv"]
    head_dim = SHAPES["n_embd"] // SHAPES["n_head"]
    for i in range(SHAPES["n_layers"]):
        h = x / np.sqrt(np.mean(x**2) + 1e-5) * w[f"blk.{i}.attn_norm.weight"]
        v = (w[f"blk.{i}.attn_v.weight"] @ h).reshape(SHAPES["n_head_kv"], head_dim)
        heads = np.concatenate([v[head // group] for head in range(SHAPES["n_head"])])
        x = x + w[f"blk.{i}.attn_output.weight"] @ heads
        h = x / np.sqrt(np.mean(x**2) + 1e-5) * w[f"blk.{i}.ffn_norm.weight"]
        gate, up = w[f"blk.{i}.ffn_gate.weight"] @ h, w[f"blk.{i}.ffn_up.weight"] @ h
        x = x + w[f"blk.{i}.ffn_down.weight"] @ (gate * (1 / (1 + np.exp(-gate))) * up)
    h = x / np.sqrt(np.mean(x**2) + 1e-5) * w["output_norm.weight"]
    expected = w["token_embd.weight"] @ h

    got = naive_logits(tiny_gguf("F32"), [token])
    assert got.shape == (1, SHAPES["n_vocab"]) and got.dtype == np.float64
    np.testing.assert_allclose(got[0], expected, rtol=1e-5, atol=1e-5)  # eps is stored as f32


def test_reference_is_causal(tiny_gguf):
    """Changing token 9 changes the logits from position 9 on, and none before it."""
    ids = _token_ids(24)
    edited = ids[:9] + [ids[9] ^ 1] + ids[10:]
    before, after = naive_logits(tiny_gguf("F32"), ids), naive_logits(tiny_gguf("F32"), edited)
    np.testing.assert_allclose(before[:9], after[:9], rtol=1e-12, atol=1e-12)
    assert all(not np.allclose(before[t], after[t]) for t in range(9, 24))
    np.testing.assert_allclose(naive_logits(tiny_gguf("F32"), ids[:12]), before[:12], rtol=1e-12, atol=1e-12)


def test_reference_attention_matches_torch_sdpa():
    """Multi-token attention (1/sqrt(head_dim) scale, causal mask, GQA head h -> kv head
    h // group) against torch's scaled_dot_product_attention on the same rotated q, k."""
    torch = pytest.importorskip("torch")
    hp = LlamaHyperparams(n_layers=1, n_embd=64, n_head=4, n_head_kv=2, n_ff=0, n_vocab=0,
                          rms_norm_eps=1e-5, rope_base=10000.0, rope_freq_scale=0.5)
    rng = np.random.default_rng(6)
    n_tokens, hd = 7, hp.head_dim
    w = {f"blk.0.attn_{name}.weight": rng.standard_normal((rows, 64)) / 8
         for name, rows in (("q", 64), ("k", 32), ("v", 32), ("output", 64))}
    h = rng.standard_normal((n_tokens, 64))

    def rotate(x: np.ndarray) -> np.ndarray:  # (T, heads, hd), each position by its index
        return np.stack([rope_adjacent_pairs(x[t], t, hp.rope_base, hp.rope_freq_scale) for t in range(n_tokens)])

    q = rotate((h @ w["blk.0.attn_q.weight"].T).reshape(n_tokens, 4, hd))
    k = rotate((h @ w["blk.0.attn_k.weight"].T).reshape(n_tokens, 2, hd))
    v = (h @ w["blk.0.attn_v.weight"].T).reshape(n_tokens, 2, hd)
    as_heads = lambda x: torch.from_numpy(np.ascontiguousarray(x.transpose(1, 0, 2)))  # (heads, T, hd)
    out = torch.nn.functional.scaled_dot_product_attention(
        as_heads(q), as_heads(k).repeat_interleave(2, dim=0), as_heads(v).repeat_interleave(2, dim=0), is_causal=True
    )
    expected = out.numpy().transpose(1, 0, 2).reshape(n_tokens, 64) @ w["blk.0.attn_output.weight"].T
    np.testing.assert_allclose(attention(h, w, 0, hp), expected, rtol=1e-10, atol=1e-10)


def test_untied_output_uses_output_weight(tiny_gguf):
    hp, w = read_llama_gguf(tiny_gguf("F32", tied_output=False))
    assert "output.weight" in w and not np.allclose(w["output.weight"], w["token_embd.weight"])
    ids = _token_ids(4)
    assert not np.allclose(naive_logits(tiny_gguf("F32", tied_output=False), ids), naive_logits(tiny_gguf("F32"), ids))


def _hf_rotate_half_rope(x: np.ndarray, position: float, base: float) -> np.ndarray:
    """transformers' LlamaRotaryEmbedding + apply_rotary_pos_emb for one head vector x (d,)."""
    d = x.shape[-1]
    inv_freq = base ** (-np.arange(0, d, 2) / d)
    angles = np.concatenate([position * inv_freq, position * inv_freq])
    rotated_half = np.concatenate([-x[d // 2 :], x[: d // 2]])
    return x * np.cos(angles) + rotated_half * np.sin(angles)


def _converter_permute(x: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute applied to Q/K output rows (here: a vector)."""
    return x.reshape(n_head, 2, x.shape[0] // n_head // 2).swapaxes(1, 2).reshape(x.shape)


def test_rope_adjacent_pairs_equals_hf_rope_through_the_converter_permutation():
    rng = np.random.default_rng(3)
    n_head, head_dim = 4, 64
    q_hf = rng.standard_normal(n_head * head_dim)
    for position in (0, 1, 7, 130):
        hf = np.concatenate([_hf_rotate_half_rope(h, position, 10000.0) for h in q_hf.reshape(n_head, head_dim)])
        gguf_side = rope_adjacent_pairs(_converter_permute(q_hf, n_head).reshape(n_head, head_dim), position, 10000.0)
        np.testing.assert_allclose(gguf_side.reshape(-1), _converter_permute(hf, n_head), atol=1e-12)


def test_rope_depends_on_relative_position_and_linear_scaling_divides_it():
    rng = np.random.default_rng(4)
    q, k = rng.standard_normal(64), rng.standard_normal(64)
    score = lambda m, n, scale=1.0: rope_adjacent_pairs(q, m, 500.0, scale) @ rope_adjacent_pairs(k, n, 500.0, scale)
    assert score(9, 4) == pytest.approx(score(105, 100), rel=1e-9)
    assert score(9, 4) != pytest.approx(score(9, 5), rel=1e-3)
    np.testing.assert_allclose(rope_adjacent_pairs(q, 12, 500.0, 0.25), rope_adjacent_pairs(q, 3, 500.0), atol=1e-12)


def test_fidelity_measures_by_hand():
    expected = np.array([[0.0, 1.0, 0.99], [2.0, 0.0, 0.0], [0.0, 3.0, 0.0]])
    actual = np.array([[0.0, 0.98, 1.0], [2.0, 0.0, 0.0], [0.0, 0.0, 3.0]])
    f = fidelity(expected, actual, margin=0.5)
    assert f.n_positions == 3 and f.top1 == pytest.approx(1 / 3)
    assert f.n_confident == 2 and f.top1_confident == 0.5   # row 0 is a tie (margin 0.01)
    assert f.worst_regret == pytest.approx(3.0) and f.max_abs_diff == pytest.approx(3.0)
    tie = fidelity(expected[:2], actual[:2], margin=0.5)
    assert tie.top1_confident == 1.0 and tie.worst_regret == pytest.approx(0.01) and 0 < tie.mean_kl < 1e-3
    assert fidelity(expected, expected).mean_kl == 0.0


# --------------------------------------------------------------------------------------------
# Against llama.cpp


@requires_llama_cpp
def test_llama_cpp_loads_the_tokenizer(tiny_gguf):
    import llama_cpp

    llm = llama_cpp.Llama(str(tiny_gguf("F32")), vocab_only=True, verbose=False)
    assert llm.n_vocab() == SHAPES["n_vocab"]
    assert llm.token_bos() == 1 and llm.token_eos() == 2
    tokens, _, _ = tiny_bpe_vocab(SHAPES["n_vocab"])
    ids = llm.tokenize(b"The fox and the dog", add_bos=False)
    assert [tokens[i] for i in ids] == ["The", "Ġfox", "Ġand", "Ġthe", "Ġdog"]
    assert llm.detokenize(llm.tokenize("naïve café ✓".encode(), add_bos=False)) == "naïve café ✓".encode()
    assert llm.tokenize(b"<|im_start|>user", add_bos=False, special=True)[0] == 1


LLAMA_CPP_CASES = {
    # name: (tensor type, writer options)
    "F32": ("F32", {}),
    "F32-untied-rope-scaled": (
        "F32", {"tied_output": False, "rope_scaling": {"type": "linear", "factor": 4.0}, "seed": 1}
    ),
    **{t.name: (t.name, {}) for t in TENSOR_TYPES if t != QType.F32},
}

# Tolerances per tensor type: (max mean KL, min top-1 over positions whose reference top-2
# margin exceeds MARGIN, max worst regret, max |logit diff| or None). llama.cpp keeps the KV
# cache in f16, rounds activations to bf16 for BF16 weights, and to 8-bit blocks (Q8_0 / Q8_1 /
# Q8_K) for the quantized types; in this random model (logit std ~1.6, many small top-1/top-2
# gaps) that flips the argmax at a few near-ties, so plain top-1 is not asserted: one flip over
# 96 positions is 1%. Measured on 96 positions, 2026-11-30, Intel Xeon (AVX-512 + VNNI, no
# AMX), the same with the AVX2 kernels forced (llama.cpp's kernels do not change with it):
#   F32 KL 5.1e-7, max |diff| 0.0063, top-1 1.0;  F16 KL 1.3e-6, max |diff| 0.0079, top-1 1.0;
#   BF16 KL 5.5e-5, max |diff| 0.046, top-1 0.990 (one flip at a margin of 0.016: the former
#   bar of 0.99 failed here and on Zen 4);  Q8_0 KL 6.4e-4, top-1 0.979, regret 0.029;
#   other quantized types KL 6.5e-4 - 1.4e-3, top-1 0.94 - 0.99, regret <= 0.126 (Q4_K);
#   every type: top-1 1.0 over the 65-77 positions with a margin > 0.2.
# Zen 4 (issue 14): the same picture (quantized top-1 0.94-0.99, regret <= 0.13, BF16 0.98958).
# Broken on purpose in the numpy reference (RoPE base x0.1 or x10, no 1/sqrt(head_dim) scale, K
# and V swapped), on F32, BF16, Q8_0, Q4_0 and Q4_K: KL 0.63 - 2.3, top-1 (margin > 0.2) at most
# 0.44, worst regret at least 5.1: every assertion below fails.
MARGIN = 0.2
LLAMA_CPP_TOLERANCES = {
    "F32": (1e-5, 0.97, 0.05, 0.02), "F16": (1e-5, 0.97, 0.05, 0.02), "BF16": (2e-4, 0.97, 0.1, 0.1),
    "Q8_0": (2e-3, 0.97, 0.15, None),
}
QUANTIZED_TOLERANCE = (3e-3, 0.97, 0.3, None)


@requires_llama_cpp
@pytest.mark.parametrize("case", LLAMA_CPP_CASES)
def test_reference_agrees_with_llama_cpp(tiny_gguf, case):
    import llama_cpp

    tensor_type, options = LLAMA_CPP_CASES[case]
    path = tiny_gguf(tensor_type, **options)
    ids = _token_ids(96, seed=5)
    llm = llama_cpp.Llama(str(path), n_ctx=128, n_batch=128, logits_all=True, n_threads=2, verbose=False)
    llm.eval(ids)
    theirs = np.array(llm.scores[: len(ids)], dtype=np.float64)
    f = fidelity(naive_logits(path, ids), theirs, margin=MARGIN)

    max_kl, min_top1_confident, max_regret, max_abs_diff = LLAMA_CPP_TOLERANCES.get(tensor_type, QUANTIZED_TOLERANCE)
    assert f.mean_kl < max_kl, f
    assert f.n_confident >= 48 and f.top1_confident >= min_top1_confident, f
    assert f.worst_regret < max_regret, f   # every disagreement is a near-tie
    if max_abs_diff is not None:
        assert f.max_abs_diff < max_abs_diff, f
