"""A naive float64 numpy forward pass of a llama-architecture GGUF, as llama.cpp computes it.

Independent of localrun: reads the file with gguf-py, dequantizes every tensor with
`gguf.quants.dequantize`, and runs the transformer one position at a time with full causal
attention over the prefix. Slow and simple on purpose; for tiny models in tests.

What llama.cpp does for `general.architecture = llama` (src/llama-model.cpp, ggml-cpu/ops.cpp):
- RMSNorm: x / sqrt(mean(x^2) + eps) * weight, eps = llama.attention.layer_norm_rms_epsilon.
- RoPE of type LLAMA_ROPE_TYPE_NORM: rotate ADJACENT pairs (x[2i], x[2i+1]) of each head by
  pos * freq_scale * base^(-2i/d). (The HF->GGUF converter permutes the Q/K rows so that this
  equals HF's rotate_half pairing (x[i], x[i+d/2]) on the original weights.) Linear rope
  scaling sets freq_scale = 1/llama.rope.scaling.factor.
- GQA: query head h reads kv head h // (n_head / n_head_kv); scores scaled by 1/sqrt(head_dim).
- SwiGLU FFN: down(silu(gate(x)) * up(x)); final RMSNorm; output head = output.weight, or
  token_embd.weight when the file has no output.weight (tied embeddings).
GGUF shapes are numpy shapes reversed: a GGUF [n_embd, n_vocab] tensor is a (n_vocab, n_embd) array.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from fidelity import Fidelity, fidelity


@dataclass(frozen=True)
class LlamaHyperparams:
    n_layers: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    rms_norm_eps: float
    rope_base: float
    rope_freq_scale: float  # 1 / linear scaling factor

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def read_llama_gguf(path: str | Path) -> tuple[LlamaHyperparams, dict[str, np.ndarray]]:
    """Hyperparameters and every tensor dequantized to float64, by GGUF name, in numpy shape order."""
    reader = gguf.GGUFReader(path)

    def field(key: str, default=None):
        return reader.fields[key].contents() if key in reader.fields else default

    arch = field("general.architecture")
    assert arch == "llama", f"{path}: architecture {arch!r}, expected 'llama'"
    weights = {
        tensor.name: np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float64)
        .reshape([int(n) for n in reversed(tensor.shape)])
        for tensor in reader.tensors
    }
    scaling_type = field("llama.rope.scaling.type", "none")
    assert scaling_type in ("none", "linear"), f"rope scaling {scaling_type!r} not implemented here"
    scaling_factor = field("llama.rope.scaling.factor", 1.0) if scaling_type == "linear" else 1.0
    n_embd = field("llama.embedding_length")
    n_head = field("llama.attention.head_count")
    assert field("llama.rope.dimension_count", n_embd // n_head) == n_embd // n_head  # llama: n_rot == head_dim
    hparams = LlamaHyperparams(
        n_layers=field("llama.block_count"),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=field("llama.attention.head_count_kv", n_head),
        n_ff=field("llama.feed_forward_length"),
        n_vocab=weights["token_embd.weight"].shape[0],
        rms_norm_eps=field("llama.attention.layer_norm_rms_epsilon"),
        rope_base=field("llama.rope.freq_base", 10000.0),
        rope_freq_scale=1.0 / scaling_factor,
    )
    return hparams, weights


def naive_logits(path: str | Path, token_ids: list[int] | np.ndarray) -> np.ndarray:
    """Next-token logits at every position, shape (len(token_ids), n_vocab), float64."""
    hp, w = read_llama_gguf(path)
    x = w["token_embd.weight"][np.asarray(token_ids)]  # (T, n_embd)
    for i in range(hp.n_layers):
        x = x + attention(rms_norm(x, w[f"blk.{i}.attn_norm.weight"], hp.rms_norm_eps), w, i, hp)
        x = x + feed_forward(rms_norm(x, w[f"blk.{i}.ffn_norm.weight"], hp.rms_norm_eps), w, i)
    output = w.get("output.weight", w["token_embd.weight"])  # (n_vocab, n_embd)
    return rms_norm(x, w["output_norm.weight"], hp.rms_norm_eps) @ output.T


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope_adjacent_pairs(x: np.ndarray, position: float, base: float, freq_scale: float = 1.0) -> np.ndarray:
    """Rotate pairs (x[..., 2i], x[..., 2i+1]) by position * freq_scale * base^(-2i/d)."""
    d = x.shape[-1]
    theta = position * freq_scale * base ** (-np.arange(0, d, 2) / d)  # (d/2,)
    cos, sin = np.cos(theta), np.sin(theta)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def attention(h: np.ndarray, w: dict[str, np.ndarray], layer: int, hp: LlamaHyperparams) -> np.ndarray:
    """Causal GQA self-attention of the normed hidden states h (T, n_embd)."""
    n_tokens, hd = h.shape[0], hp.head_dim
    q = (h @ w[f"blk.{layer}.attn_q.weight"].T).reshape(n_tokens, hp.n_head, hd)
    k = (h @ w[f"blk.{layer}.attn_k.weight"].T).reshape(n_tokens, hp.n_head_kv, hd)
    v = (h @ w[f"blk.{layer}.attn_v.weight"].T).reshape(n_tokens, hp.n_head_kv, hd)
    for t in range(n_tokens):
        q[t] = rope_adjacent_pairs(q[t], t, hp.rope_base, hp.rope_freq_scale)
        k[t] = rope_adjacent_pairs(k[t], t, hp.rope_base, hp.rope_freq_scale)

    group = hp.n_head // hp.n_head_kv
    out = np.empty((n_tokens, hp.n_head, hd))
    for t in range(n_tokens):
        for head in range(hp.n_head):
            kv_head = head // group
            scores = k[: t + 1, kv_head] @ q[t, head] / np.sqrt(hd)  # (t+1,)
            probs = np.exp(scores - scores.max())
            probs /= probs.sum()
            out[t, head] = probs @ v[: t + 1, kv_head]
    return out.reshape(n_tokens, hp.n_head * hd) @ w[f"blk.{layer}.attn_output.weight"].T


def feed_forward(h: np.ndarray, w: dict[str, np.ndarray], layer: int) -> np.ndarray:
    gate = h @ w[f"blk.{layer}.ffn_gate.weight"].T
    up = h @ w[f"blk.{layer}.ffn_up.weight"].T
    return (gate / (1.0 + np.exp(-gate)) * up) @ w[f"blk.{layer}.ffn_down.weight"].T


# Comparisons of logits live in fidelity.py; these names stay for the tests that import them here.
LogitComparison = Fidelity
compare_logits = fidelity
