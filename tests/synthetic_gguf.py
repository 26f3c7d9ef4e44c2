"""Tiny llama-architecture GGUF files with random weights, laid out as llama.cpp's converter does.
`write_tiny_model(path, architecture=...)` writes the other families (qwen2, qwen3, gemma3) the
same way, with their extra tensors (biases, Q/K head norms, post-norms) and keys.

`write_tiny_llama(path, tensor_type=...)` writes a complete model (hyperparameters, a small
byte-level BPE tokenizer, a ChatML template, and random weights) that llama.cpp can load.
The float weights depend only on the seed and the shapes, so files of different tensor
types hold the same model up to quantization error; `tiny_llama_weights` returns them.

gguf-py quantizes F16, BF16 and the 32-wide block types; the K-quants (Q4_K, Q5_K, Q6_K)
are quantized here with a simple round-to-nearest quantizer that packs the bits exactly as
ggml's `block_q4_K` / `block_q5_K` / `block_q6_K` structs do.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf.gguf_writer import GGUFValue

TENSOR_TYPES: tuple[QType, ...] = (
    QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1,
    QType.Q5_0, QType.Q5_1, QType.Q4_K, QType.Q5_K, QType.Q6_K,
)

# general.file_type as llama.cpp's quantize tool writes it for a model "mostly" of this type.
_FILE_TYPES = {
    QType.F32: gguf.LlamaFileType.ALL_F32,
    QType.F16: gguf.LlamaFileType.MOSTLY_F16,
    QType.BF16: gguf.LlamaFileType.MOSTLY_BF16,
    QType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
    QType.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
    QType.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
    QType.Q5_0: gguf.LlamaFileType.MOSTLY_Q5_0,
    QType.Q5_1: gguf.LlamaFileType.MOSTLY_Q5_1,
    QType.Q4_K: gguf.LlamaFileType.MOSTLY_Q4_K_M,
    QType.Q5_K: gguf.LlamaFileType.MOSTLY_Q5_K_M,
    QType.Q6_K: gguf.LlamaFileType.MOSTLY_Q6_K,
}

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
BOS_TOKEN_ID = 1  # <|im_start|>, as in SmolLM2
EOS_TOKEN_ID = 2  # <|im_end|>
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
RMS_NORM_EPS = 1e-5

# Text the tiny BPE tokenizer's merges are learned from.
_BPE_CORPUS = (
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox "
    "runs into the forest. There is a river in the forest; the water is cold and the "
    "stones are smooth. In the morning the birds sing, and in the evening the wind is "
    "quiet. This is the story of the fox and the dog, and of the river that runs "
    "between them. def main():\n    return 0\n\nfor i in range(10):\n    print(i)\n"
    "One, two, three, four, five: numbers 12345 and 67890 are in the text, too. "
)


def write_tiny_llama(
    path: str | Path,
    *,
    tensor_type: QType | str,
    n_layers: int = 2,
    n_embd: int = 256,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 512,
    n_vocab: int = 320,
    tied_output: bool = True,
    rope_base: float = 10000.0,
    rope_scaling: dict | None = None,
    context_length: int = 256,
    seed: int = 0,
    chat_template: str | None = CHATML_TEMPLATE,
    metadata: dict | None = None,
    architecture: str = "llama",
    head_dim: int | None = None,
    sliding_window: int | None = None,
) -> Path:
    """Write a llama-architecture GGUF with random weights and return its path.

    `tensor_type` (a `GGMLQuantizationType` or its name, e.g. "Q4_K") is the storage type of
    every 2-D matrix; norm weights stay F32 as in llama.cpp's files. `rope_scaling` is None
    or `{"type": "linear", "factor": F}`. K-quant types need rows that are multiples of 256
    (n_embd and n_ff), the other block types multiples of 32.

    For hostile-file tests: `chat_template` None writes no template; `metadata` maps keys to
    values that replace or add to the written ones (None deletes the key), a value being
    `(value, GGUFValueType)`, `(list, ARRAY, item GGUFValueType)` or a plain bool/int/float/str/list (typed as llama.cpp's
    converter would: uint32, float32, string; lists by their first item).
    """
    tensor_type = _as_qtype(tensor_type)
    if rope_scaling is not None and (rope_scaling.get("type") != "linear" or "factor" not in rope_scaling):
        raise ValueError(f"only linear rope scaling is supported, got {rope_scaling!r}")
    assert (head_dim or n_embd % n_head == 0) and n_head % n_head_kv == 0
    explicit_head_dim = head_dim is not None
    head_dim = head_dim or n_embd // n_head
    tokens, token_types, merges = tiny_bpe_vocab(n_vocab)
    weights = tiny_llama_weights(
        n_layers=n_layers, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff,
        n_vocab=n_vocab, tied_output=tied_output, seed=seed, architecture=architecture, head_dim=head_dim,
    )

    path = Path(path)
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_name("tiny-llama-synthetic")
    writer.add_vocab_size(n_vocab)
    writer.add_context_length(context_length)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_freq_base(rope_base)
    writer.add_layer_norm_rms_eps(RMS_NORM_EPS)
    writer.add_rope_dimension_count(head_dim)
    if explicit_head_dim:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if sliding_window is not None:
        writer.add_sliding_window(sliding_window)
    if rope_scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope_scaling["factor"]))
    writer.add_file_type(_FILE_TYPES[tensor_type])

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_TOKEN_ID)
    writer.add_eos_token_id(EOS_TOKEN_ID)
    writer.add_pad_token_id(EOS_TOKEN_ID)
    writer.add_add_bos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for key, value in (metadata or {}).items():
        writer.kv_data[0].pop(key, None)
        if value is not None:
            writer.kv_data[0][key] = _gguf_value(value)

    for name, array in weights.items():
        if array.ndim == 1:
            writer.add_tensor(name, array)  # norm weights: F32
        else:
            writer.add_tensor(name, quantize(array, tensor_type), raw_dtype=tensor_type)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_value(value) -> GGUFValue:
    """A metadata value for GGUFWriter: (value, type) as given, or typed from the Python value."""
    if isinstance(value, tuple):     # (value, type) or (array, ARRAY, item type)
        value, vtype, *sub = value
        if not sub:
            sub = [_value_type(value[0]) if vtype == gguf.GGUFValueType.ARRAY and value else None]
        return GGUFValue(value=value, type=vtype, sub_type=sub[0])
    if isinstance(value, list):
        return GGUFValue(value=value, type=gguf.GGUFValueType.ARRAY,
                              sub_type=_value_type(value[0]) if value else gguf.GGUFValueType.UINT32)
    return GGUFValue(value=value, type=_value_type(value))


def _value_type(value) -> gguf.GGUFValueType:
    if isinstance(value, bool):
        return gguf.GGUFValueType.BOOL
    if isinstance(value, int):
        return gguf.GGUFValueType.UINT32 if 0 <= value < 2**32 else gguf.GGUFValueType.INT64
    if isinstance(value, float):
        return gguf.GGUFValueType.FLOAT32
    return gguf.GGUFValueType.STRING


def write_tiny_model(path: str | Path, *, architecture: str, tensor_type: QType | str = QType.F32,
                     **options) -> Path:
    """A tiny model of another family: qwen2 (Q/K/V biases), qwen3 (Q/K norms, head_dim 128 so
    that n_head x head_dim != n_embd), gemma3 (also post-norms, head_dim 128 and a sliding
    window of 8 tokens, so that 6 of its 7 layers are local and short prompts cross the window).
    `options` go to write_tiny_llama and override these defaults."""
    defaults = {"qwen2": {"rope_base": 1e6},
                "qwen3": {"head_dim": 128, "rope_base": 1e6},
                "gemma3": {"head_dim": 128, "sliding_window": 8, "n_layers": 7, "rope_base": 1e6, "n_head_kv": 1},
                "llama": {}}[architecture]
    return write_tiny_llama(path, tensor_type=tensor_type, architecture=architecture, **{**defaults, **options})


def tiny_llama_weights(
    *, n_layers: int, n_embd: int, n_head: int, n_head_kv: int, n_ff: int, n_vocab: int,
    tied_output: bool, seed: int, architecture: str = "llama", head_dim: int | None = None,
) -> dict[str, np.ndarray]:
    """The float32 weights `write_tiny_llama` stores, by GGUF tensor name, in numpy shape order.

    Linear layers are N(0, 1/fan_in) so activations keep unit scale; the embedding is N(0, 0.1)
    so that tied logits have a spread of a few units; norm weights are U(0.8, 1.2).
    """
    rng = np.random.default_rng(seed)
    head_dim = head_dim or n_embd // n_head
    extra = np.random.default_rng(seed + 1000)   # the other families' tensors; llama's stay as they were

    def linear(n_out: int, n_in: int) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)

    def norm() -> np.ndarray:
        return rng.uniform(0.8, 1.2, n_embd).astype(np.float32)

    weights = {"token_embd.weight": (0.1 * rng.standard_normal((n_vocab, n_embd))).astype(np.float32)}
    for i in range(n_layers):
        weights[f"blk.{i}.attn_norm.weight"] = norm()
        weights[f"blk.{i}.attn_q.weight"] = linear(n_head * head_dim, n_embd)
        weights[f"blk.{i}.attn_k.weight"] = linear(n_head_kv * head_dim, n_embd)
        weights[f"blk.{i}.attn_v.weight"] = linear(n_head_kv * head_dim, n_embd)
        weights[f"blk.{i}.attn_output.weight"] = linear(n_embd, n_head * head_dim)
        weights[f"blk.{i}.ffn_norm.weight"] = norm()
        weights[f"blk.{i}.ffn_gate.weight"] = linear(n_ff, n_embd)
        weights[f"blk.{i}.ffn_up.weight"] = linear(n_ff, n_embd)
        weights[f"blk.{i}.ffn_down.weight"] = linear(n_embd, n_ff)
        if architecture == "qwen2":     # biases of a few units, as Qwen's K biases are
            for name, n in (("attn_q", n_head), ("attn_k", n_head_kv), ("attn_v", n_head_kv)):
                weights[f"blk.{i}.{name}.bias"] = extra.normal(0, 0.5, n * head_dim).astype(np.float32)
        if architecture in ("qwen3", "gemma3"):
            weights[f"blk.{i}.attn_q_norm.weight"] = extra.uniform(0.8, 1.2, head_dim).astype(np.float32)
            weights[f"blk.{i}.attn_k_norm.weight"] = extra.uniform(0.8, 1.2, head_dim).astype(np.float32)
        if architecture == "gemma3":
            weights[f"blk.{i}.post_attention_norm.weight"] = extra.uniform(0.8, 1.2, n_embd).astype(np.float32)
            weights[f"blk.{i}.post_ffw_norm.weight"] = extra.uniform(0.8, 1.2, n_embd).astype(np.float32)
    weights["output_norm.weight"] = norm()
    if not tied_output:
        weights["output.weight"] = (0.1 * rng.standard_normal((n_vocab, n_embd))).astype(np.float32)
    return weights


# ---------------------------------------------------------------------------------------------
# Quantization


def quantize(weights: np.ndarray, tensor_type: QType | str) -> np.ndarray:
    """`weights` (rows, cols) float32 in the storage form GGUFWriter.add_tensor takes for the type."""
    tensor_type = _as_qtype(tensor_type)
    if tensor_type == QType.Q4_K:
        return _quantize_q4_k_or_q5_k(weights, n_bits=4)
    if tensor_type == QType.Q5_K:
        return _quantize_q4_k_or_q5_k(weights, n_bits=5)
    if tensor_type == QType.Q6_K:
        return _quantize_q6_k(weights)
    return gguf.quants.quantize(weights, tensor_type)


def _quantize_q4_k_or_q5_k(weights: np.ndarray, *, n_bits: int) -> np.ndarray:
    """x ~ d*sc[j]*q - dmin*m[j] per 32-wide sub-block j of each 256-wide super-block."""
    n_rows, n_cols = weights.shape
    assert n_cols % 256 == 0, f"K-quant rows must be multiples of 256, got {n_cols}"
    q_max = 2**n_bits - 1
    x = weights.reshape(-1, 8, 32).astype(np.float32)  # (n_blocks, sub-block, element)
    lo = np.minimum(x.min(axis=-1), 0.0)
    hi = np.maximum(x.max(axis=-1), 0.0)
    scale = (hi - lo) / q_max  # (n_blocks, 8)
    minimum = -lo
    d = _f16_round(scale.max(axis=-1) / 63)  # (n_blocks,)
    dmin = _f16_round(minimum.max(axis=-1) / 63)
    sc = np.clip(np.round(_safe_div(scale, d[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.round(_safe_div(minimum, dmin[:, None])), 0, 63).astype(np.uint8)
    step = (d[:, None] * sc)[..., None]  # (n_blocks, 8, 1)
    offset = (dmin[:, None] * m)[..., None]
    q = np.clip(np.round(_safe_div(x + offset, step)), 0, q_max).astype(np.uint8)

    n_blocks = x.shape[0]
    q = q.reshape(n_blocks, 4, 2, 32)  # sub-block 2c+h of chunk c
    qs = (q[:, :, 0] & 0xF) | ((q[:, :, 1] & 0xF) << 4)  # (n_blocks, 4, 32): nibbles
    parts = [
        d.astype(np.float16).view(np.uint8).reshape(n_blocks, 2),
        dmin.astype(np.float16).view(np.uint8).reshape(n_blocks, 2),
        _pack_k_scales(sc, m),
    ]
    if n_bits == 5:
        high = (q.reshape(n_blocks, 8, 32) >> 4) & 1  # bit 4 of sub-block j goes to bit j
        parts.append((high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8))
    parts.append(qs.reshape(n_blocks, 128))
    return np.concatenate(parts, axis=1).reshape(n_rows, -1)


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The 12-byte 6-bit scale/min packing of block_q4_K (ggml's get_scale_min_k4, inverted)."""
    packed = np.empty((sc.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return packed


def _quantize_q6_k(weights: np.ndarray) -> np.ndarray:
    """x ~ d*sc[j]*(q-32) per 16-wide sub-block j; sc is int8 and half of them are negative."""
    n_rows, n_cols = weights.shape
    assert n_cols % 256 == 0, f"K-quant rows must be multiples of 256, got {n_cols}"
    x = weights.reshape(-1, 16, 16).astype(np.float32)
    n_blocks = x.shape[0]
    scale = np.abs(x).max(axis=-1) / 31  # symmetric, so q-32 in [-31, 31] survives a sign flip
    d = _f16_round(scale.max(axis=-1) / 127)
    sign = np.where(np.arange(16) % 2 == 0, 1, -1)[None, :]  # exercise negative int8 scales
    sc = (sign * np.clip(np.round(_safe_div(scale, d[:, None])), 0, 127)).astype(np.int8)
    step = (d[:, None] * sc)[..., None]
    q = (np.clip(np.round(_safe_div(x, step)), -31, 31) + 32).astype(np.uint8).reshape(n_blocks, 256)

    q = q.reshape(n_blocks, 2, 4, 32)  # (half, quarter, element): element 128h + 32k + l
    ql = np.concatenate([q[:, :, 0] & 0xF, q[:, :, 1] & 0xF], axis=-1) | (
        np.concatenate([q[:, :, 2] & 0xF, q[:, :, 3] & 0xF], axis=-1) << 4
    )  # (n_blocks, 2, 64)
    qh = ((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(axis=2, dtype=np.uint8)
    parts = [
        ql.reshape(n_blocks, 128),
        qh.reshape(n_blocks, 64),
        sc.view(np.uint8),
        d.astype(np.float16).view(np.uint8).reshape(n_blocks, 2),
    ]
    return np.concatenate(parts, axis=1).reshape(n_rows, -1)


def _f16_round(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32), where=b != 0)


def _as_qtype(tensor_type: QType | str) -> QType:
    qtype = QType[tensor_type] if isinstance(tensor_type, str) else QType(tensor_type)
    if qtype not in TENSOR_TYPES:
        raise ValueError(f"unsupported tensor type {qtype.name}; choose one of {[t.name for t in TENSOR_TYPES]}")
    return qtype


# ---------------------------------------------------------------------------------------------
# Header fields


def header_fields(data: bytes) -> list[tuple[int, int, str, str]]:
    """(offset, size, kind, owner) of every length, count, type and scalar field of a valid GGUF
    header; owner is the metadata key or tensor name the field belongs to ("" for the counts).
    For tests that set one field to a hostile value."""
    fields, pos = [(8, 8, "tensor count", ""), (16, 8, "metadata count", "")], 24
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)

    def string(kind, owner):
        nonlocal pos
        fields.append((pos, 8, kind, owner))
        pos += 8 + struct.unpack_from("<Q", data, pos)[0]

    def value(type_id, owner):
        nonlocal pos
        if type_id == 8:
            string("string length", owner)
        elif type_id == 9:
            item_type, n = struct.unpack_from("<IQ", data, pos)
            fields.extend([(pos, 4, "array type", owner), (pos + 4, 8, "array count", owner)])
            pos += 12
            for _ in range(n):
                value(item_type, owner)
        else:
            size = struct.calcsize("<" + _SCALARS[type_id])
            fields.append((pos, size, "scalar", owner))
            pos += size

    for _ in range(n_kv):
        n = struct.unpack_from("<Q", data, pos)[0]
        key = data[pos + 8:pos + 8 + n].decode()
        string("key length", key)
        fields.append((pos, 4, "value type", key))
        pos += 4
        value(struct.unpack_from("<I", data, pos - 4)[0], key)
    for _ in range(n_tensors):
        n = struct.unpack_from("<Q", data, pos)[0]
        name = data[pos + 8:pos + 8 + n].decode()
        string("tensor name length", name)
        n_dims = struct.unpack_from("<I", data, pos)[0]
        fields.append((pos, 4, "n_dims", name))
        fields.extend((pos + 4 + 8 * d, 8, "dimension", name) for d in range(n_dims))
        pos += 4 + 8 * n_dims
        fields.extend([(pos, 4, "tensor type", name), (pos + 4, 8, "tensor offset", name)])
        pos += 12
    return fields


def set_field(data: bytes, kind: str, owner: str, value: int) -> bytes:
    """data with the first `kind` field of `owner` (see header_fields) set to `value`."""
    offset, size = next((o, s) for o, s, k, w in header_fields(data) if k == kind and w == owner)
    return data[:offset] + (value % 2**(8 * size)).to_bytes(size, "little") + data[offset + size:]


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


# ---------------------------------------------------------------------------------------------
# Tokenizer


def tiny_bpe_vocab(n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a GPT-2-style byte-level BPE vocabulary of n_vocab tokens.

    Ids 0-2 are the special tokens, ids 3-258 the 256 bytes (id = 3 + byte value) in GPT-2's
    byte-to-unicode spelling, and the rest merges learned from a small English/code corpus;
    if the corpus runs out of merges, unused filler tokens pad the vocabulary.
    """
    n_base = len(SPECIAL_TOKENS) + 256
    if n_vocab < n_base:
        raise ValueError(f"n_vocab must be at least {n_base}, got {n_vocab}")
    byte_chars = bytes_to_unicode()
    tokens = list(SPECIAL_TOKENS) + [byte_chars[b] for b in range(256)]
    token_types = [gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS) + [gguf.TokenType.NORMAL] * 256
    merges = _learn_merges(_BPE_CORPUS, n_vocab - n_base, byte_chars)
    for left, right in merges:
        if left + right not in tokens:  # two merges may spell the same token
            tokens.append(left + right)
            token_types.append(gguf.TokenType.NORMAL)
    for i in range(n_vocab - len(tokens)):
        tokens.append(f"<|unused_{i}|>")
        token_types.append(gguf.TokenType.UNUSED)
    return tokens, [int(t) for t in token_types], [f"{left} {right}" for left, right in merges]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters (space -> 'Ġ')."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + n)
            n += 1
    return mapping


def _learn_merges(text: str, n_new_tokens: int, byte_chars: dict[int, str]) -> list[tuple[str, str]]:
    """Plain BPE training: repeatedly merge the most frequent adjacent pair within pre-tokens,
    until the merges spell n_new_tokens distinct tokens or the corpus has no pairs left."""
    pieces = re.findall(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+", text)
    words: dict[tuple[str, ...], int] = {}
    for piece in pieces:
        word = tuple(byte_chars[b] for b in piece.encode("utf-8"))
        words[word] = words.get(word, 0) + 1
    merges: list[tuple[str, str]] = []
    new_tokens: set[str] = set()
    while len(new_tokens) < n_new_tokens:
        counts: dict[tuple[str, str], int] = {}
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                counts[pair] = counts.get(pair, 0) + count
        if not counts:
            break
        best = min(counts, key=lambda pair: (-counts[pair], pair))  # most frequent, then lexical
        merges.append(best)
        new_tokens.add(best[0] + best[1])
        words = {_merge_pair(word, best): count for word, count in words.items()}
    return merges


def _merge_pair(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    merged: list[str] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            merged.append(word[i] + word[i + 1])
            i += 2
        else:
            merged.append(word[i])
            i += 1
    return tuple(merged)
