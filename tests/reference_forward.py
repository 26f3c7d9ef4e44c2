"""A naive float64 numpy forward pass of a llama, qwen2, qwen3 or gemma3 GGUF, as llama.cpp
computes it.

Independent of localrun: reads the file with gguf-py, dequantizes every tensor with
`gguf.quants.dequantize` (the embedding and output head a block of rows at a time, as needed),
and runs the transformer one position at a time with full causal
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

The other families (src/models/qwen2.cpp, qwen3.cpp, gemma3.cpp), written out here on their own
rather than read from localrun's architecture table, so that the two can disagree:
- qwen2: q/k/v projections add attn_q/k/v.bias; RoPE of type NEOX: rotate the pairs
  (x[i], x[i + d/2]) of each head.
- qwen3: RMSNorm of each Q and K head (attn_q_norm, attn_k_norm, over head_dim) before RoPE;
  NEOX RoPE; head_dim from qwen3.attention.key_length.
- gemma3: embeddings times sqrt(n_embd); Q/K head norms; NEOX RoPE; outputs of attention and
  FFN pass post_attention_norm / post_ffw_norm before their residual add; FFN
  down(gelu_tanh(gate) * up); layers with il % 6 < 5 attend over the last
  gemma3.attention.sliding_window positions (the query's own included) with RoPE base 10,000,
  the others over all positions with gemma3.rope.freq_base.
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
    architecture: str = "llama"
    key_length: int | None = None        # head_dim when the file sets it
    sliding_window: int | None = None    # gemma3

    @property
    def head_dim(self) -> int:
        return self.key_length or self.n_embd // self.n_head

    @property
    def neox(self) -> bool:
        return self.architecture != "llama"

    def is_local(self, layer: int) -> bool:
        return self.architecture == "gemma3" and bool(self.sliding_window) and layer % 6 < 5

    def layer_rope_base(self, layer: int) -> float:
        return 10000.0 if self.is_local(layer) else self.rope_base


class QuantizedRows:
    """A 2-D tensor left as the file stores it; rows dequantized to float64 on request (by
    `gguf.quants.dequantize`, as the other tensors). For the embedding and output head, whose
    float64 copy over a large vocabulary (1.3 GB for gemma-3's 262k x 640) took most of a test
    in first-touch page faults."""

    def __init__(self, tensor):
        self.data, self.qtype = tensor.data, tensor.tensor_type
        self.shape = tuple(int(n) for n in reversed(tensor.shape))

    def rows(self, index) -> np.ndarray:
        """The rows `index` (an index array or a slice) as float64 (rows, columns)."""
        rows = np.asarray(gguf.quants.dequantize(self.data[index], self.qtype), dtype=np.float64)
        return rows.reshape(-1, self.shape[1])


def read_llama_gguf(path: str | Path, lazy: tuple[str, ...] = ()) -> tuple[LlamaHyperparams, dict[str, np.ndarray]]:
    """Hyperparameters and every tensor dequantized to float64, by GGUF name, in numpy shape
    order; the 2-D tensors named in `lazy` as QuantizedRows instead."""
    reader = gguf.GGUFReader(path)

    def field(key: str, default=None):
        return reader.fields[key].contents() if key in reader.fields else default

    arch = field("general.architecture")
    assert arch in ("llama", "qwen2", "qwen3", "gemma3"), f"{path}: architecture {arch!r} not implemented here"
    weights = {
        tensor.name: QuantizedRows(tensor) if tensor.name in lazy else
        np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float64)
        .reshape([int(n) for n in reversed(tensor.shape)])
        for tensor in reader.tensors
    }
    scaling_type = field(f"{arch}.rope.scaling.type", "none")
    assert scaling_type in ("none", "linear"), f"rope scaling {scaling_type!r} not implemented here"
    scaling_factor = field(f"{arch}.rope.scaling.factor", 1.0) if scaling_type == "linear" else 1.0
    n_embd = field(f"{arch}.embedding_length")
    n_head = field(f"{arch}.attention.head_count")
    key_length = field(f"{arch}.attention.key_length")
    head_dim = key_length or n_embd // n_head
    assert field(f"{arch}.rope.dimension_count", head_dim) == head_dim  # n_rot == head_dim
    hparams = LlamaHyperparams(
        n_layers=field(f"{arch}.block_count"),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=field(f"{arch}.attention.head_count_kv", n_head),
        n_ff=field(f"{arch}.feed_forward_length"),
        n_vocab=weights["token_embd.weight"].shape[0],
        rms_norm_eps=field(f"{arch}.attention.layer_norm_rms_epsilon"),
        rope_base=field(f"{arch}.rope.freq_base", 10000.0),
        rope_freq_scale=1.0 / scaling_factor,
        architecture=arch,
        key_length=key_length,
        sliding_window=field(f"{arch}.attention.sliding_window"),
    )
    return hparams, weights


HEAD_CHUNK = 8192      # output rows dequantized at a time


# The GGML types localrun's integer kernel multiplies in place (localrun/kernels: KERNEL_TYPES),
# whose activations it rounds to 8-bit blocks first; written out here, not imported.
INT8_ACTIVATION_TYPES = {gguf.GGMLQuantizationType[name] for name in
                         ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")}


def q8_activations(x: np.ndarray) -> np.ndarray:
    """Activation rows (M, K) as the integer kernel sees them (and ggml's q8_0): per 32 values,
    d = amax / 127 and q = round-half-even(x * 127 / amax), in float32 as the kernel computes
    them; returned as q * d."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32).astype(np.float32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return (np.rint(blocks * inv) * (amax / np.float32(127))).reshape(m, k)


def naive_logits(path: str | Path, token_ids: list[int] | np.ndarray, int8_activations: bool = False) -> np.ndarray:
    """Next-token logits at every position, shape (len(token_ids), n_vocab), float64.
    int8_activations: the rows multiplied by a weight of INT8_ACTIVATION_TYPES are first rounded
    as q8_activations rounds them (localrun's `prompt_math="int8"` and every decode row, and
    llama.cpp's q8_0 activations); the rest of the forward stays float64."""
    hp, w = read_llama_gguf(path, lazy=("token_embd.weight", "output.weight"))
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    rounded = {name for name, t in types.items() if t in INT8_ACTIVATION_TYPES} if int8_activations else set()

    def linear(h: np.ndarray, name: str) -> np.ndarray:
        return (q8_activations(h) if name in rounded else h) @ w[name].T

    eps, gemma = hp.rms_norm_eps, hp.architecture == "gemma3"
    x = w["token_embd.weight"].rows(np.asarray(token_ids))  # (T, n_embd)
    if gemma:
        x = x * np.sqrt(hp.n_embd)
    for i in range(hp.n_layers):
        attn = attention(rms_norm(x, w[f"blk.{i}.attn_norm.weight"], eps), w, i, hp, linear)
        if gemma:
            attn = rms_norm(attn, w[f"blk.{i}.post_attention_norm.weight"], eps)
        x = x + attn
        ffn = feed_forward(rms_norm(x, w[f"blk.{i}.ffn_norm.weight"], eps), w, i, gelu=gemma, linear=linear)
        if gemma:
            ffn = rms_norm(ffn, w[f"blk.{i}.post_ffw_norm.weight"], eps)
        x = x + ffn
    head = "output.weight" if "output.weight" in w else "token_embd.weight"
    output = w[head]                                         # (n_vocab, n_embd), rows on request
    h = rms_norm(x, w["output_norm.weight"], eps)
    if head in rounded:
        h = q8_activations(h)
    return np.concatenate([h @ output.rows(slice(a, a + HEAD_CHUNK)).T for a in range(0, output.shape[0], HEAD_CHUNK)],
                          axis=1)


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


def rope_halves(x: np.ndarray, position: float, base: float, freq_scale: float = 1.0) -> np.ndarray:
    """NEOX RoPE: rotate pairs (x[..., i], x[..., i + d/2]) by position * freq_scale * base^(-2i/d)."""
    d = x.shape[-1]
    theta = position * freq_scale * base ** (-np.arange(0, d, 2) / d)  # (d/2,)
    cos, sin = np.cos(theta), np.sin(theta)
    first, second = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)


def plain_linear(w: dict[str, np.ndarray]):
    return lambda h, name: h @ w[name].T


def attention(h: np.ndarray, w: dict[str, np.ndarray], layer: int, hp: LlamaHyperparams, linear=None) -> np.ndarray:
    """Causal GQA self-attention of the normed hidden states h (T, n_embd). linear(h, name):
    h times weight `name` transposed (naive_logits' rounding of activations, or none)."""
    linear = linear or plain_linear(w)
    n_tokens, hd, p = h.shape[0], hp.head_dim, f"blk.{layer}."
    q = linear(h, p + "attn_q.weight") + w.get(p + "attn_q.bias", 0.0)
    k = linear(h, p + "attn_k.weight") + w.get(p + "attn_k.bias", 0.0)
    v = linear(h, p + "attn_v.weight") + w.get(p + "attn_v.bias", 0.0)
    q, k = q.reshape(n_tokens, hp.n_head, hd), k.reshape(n_tokens, hp.n_head_kv, hd)
    v = v.reshape(n_tokens, hp.n_head_kv, hd)
    if p + "attn_q_norm.weight" in w:
        q = rms_norm(q, w[p + "attn_q_norm.weight"], hp.rms_norm_eps)
        k = rms_norm(k, w[p + "attn_k_norm.weight"], hp.rms_norm_eps)
    rope = rope_halves if hp.neox else rope_adjacent_pairs
    base = hp.layer_rope_base(layer)
    freq_scale = 1.0 if hp.is_local(layer) else hp.rope_freq_scale
    for t in range(n_tokens):
        q[t] = rope(q[t], t, base, freq_scale)
        k[t] = rope(k[t], t, base, freq_scale)

    group = hp.n_head // hp.n_head_kv
    out = np.empty((n_tokens, hp.n_head, hd))
    for t in range(n_tokens):
        first = max(0, t + 1 - hp.sliding_window) if hp.is_local(layer) else 0   # keys first..t
        for head in range(hp.n_head):
            kv_head = head // group
            scores = k[first: t + 1, kv_head] @ q[t, head] / np.sqrt(hd)  # (t+1-first,)
            probs = np.exp(scores - scores.max())
            probs /= probs.sum()
            out[t, head] = probs @ v[first: t + 1, kv_head]
    return linear(out.reshape(n_tokens, hp.n_head * hd), f"blk.{layer}.attn_output.weight")


def feed_forward(h: np.ndarray, w: dict[str, np.ndarray], layer: int, gelu: bool = False, linear=None) -> np.ndarray:
    linear = linear or plain_linear(w)
    gate = linear(h, f"blk.{layer}.ffn_gate.weight")
    up = linear(h, f"blk.{layer}.ffn_up.weight")
    if gelu:   # ggml_gelu: the tanh approximation
        act = 0.5 * gate * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (gate + 0.044715 * gate ** 3)))
    else:
        act = gate / (1.0 + np.exp(-gate))
    return linear(act * up, f"blk.{layer}.ffn_down.weight")


# Comparisons of logits live in fidelity.py; these names stay for the tests that import them here.
LogitComparison = Fidelity
compare_logits = fidelity
