"""Llama GGUFs of random quantized blocks at the shapes users run, for benchmarks beyond the CPU's caches.

The catalog's models (SmolLM2-135M, 98 MB; gemma-3-270m, 253 MB) are small enough that a good part
of their weights stays in a 32 MB L3 between decode steps, and their types are Q4_1, Q5_0 and Q8_0
for the most part. What users bring is a 1-8B Q4_K_M file that a decode step must stream from
memory: a kernel that is fast on the first can be compute-bound on the second (on 2 Zen 4 threads,
a 1.1B Q4_K_M-shaped llama decoded at 0.65x llama.cpp while SmolLM2 decoded at 1.3-1.6x,
2026-12-05). These files have the shapes and llama.cpp's quantization mix of such models and
random codes (finite, small scales), so both engines do exactly the work of the real file; the
text is noise. Written once into the model cache's `synthetic/` folder (a few seconds; `localrun
list` does not show them), named like catalog models:

    synthetic-1b-q4_k_m   TinyLlama-1.1B's shape (22 layers of 2048, FFN 5632, 32 heads over 4
                          KV heads, vocabulary 32000), 668 MB in llama.cpp's Q4_K_M mix: Q4_K,
                          with Q6_K for the output head and for attn_v / ffn_down in the layers
                          llama.cpp gives more bits (the first and last eighth, every third between)

    resolve(name_or_path) -> Path    a synthetic name, else localrun.models.resolve_model's answer
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))   # synthetic_gguf: the BPE vocabulary


@dataclass(frozen=True)
class Shape:
    n_layers: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_vocab: int
    mix: str                # "q4_k_m" (llama.cpp's Q4_K_M choices) or "q4_0" (every matrix Q4_0)


SYNTHETIC = {
    "synthetic-1b-q4_k_m": Shape(n_layers=22, n_embd=2048, n_ff=5632, n_head=32, n_head_kv=4, n_vocab=32000,
                                 mix="q4_k_m"),
}


def more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's use_more_bits: Q4_K_M's attn_v and ffn_down take Q6_K in these layers."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def write_llama(path: Path, shape: Shape, seed: int = 0) -> Path:
    """A llama GGUF of random blocks at `shape` (no float weights are ever made: fast to write)."""
    import gguf
    from synthetic_gguf import BOS_TOKEN_ID, CHATML_TEMPLATE, EOS_TOKEN_ID, tiny_bpe_vocab

    T = gguf.GGMLQuantizationType
    rng = np.random.default_rng(seed)
    head_dim = shape.n_embd // shape.n_head
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(f"synthetic-{shape.n_layers}x{shape.n_embd}-{shape.mix}")
    for add, value in [(writer.add_vocab_size, shape.n_vocab), (writer.add_context_length, 4096),
                       (writer.add_embedding_length, shape.n_embd), (writer.add_block_count, shape.n_layers),
                       (writer.add_feed_forward_length, shape.n_ff), (writer.add_head_count, shape.n_head),
                       (writer.add_head_count_kv, shape.n_head_kv), (writer.add_rope_dimension_count, head_dim)]:
        add(value)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M if shape.mix == "q4_k_m" else gguf.LlamaFileType.MOSTLY_Q4_0)
    tokens, types, merges = tiny_bpe_vocab(shape.n_vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_TOKEN_ID)
    writer.add_eos_token_id(EOS_TOKEN_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)

    def f16(value: float, n: int) -> np.ndarray:
        return np.full(n, value, dtype=np.float16).view(np.uint8).reshape(n, 2)

    def blocks(qtype, n_out: int, n_in: int) -> np.ndarray:
        """Random codes; the scales set so that a row's values have a standard deviation near 1 / sqrt(n_in)."""
        values, size = gguf.GGML_QUANT_SIZES[qtype]
        n = n_out * n_in // values
        raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
        spread = 1.0 / np.sqrt(n_in)
        if qtype == T.Q4_0:                         # d * (q - 8), q < 16
            raw[:, 0:2] = f16(spread / 4.6, n)
        elif qtype == T.Q4_K:                       # d * sc * q - dmin * m, 6-bit sc and m, q < 16
            raw[:, 0:2] = f16(spread / 150.0, n)
            raw[:, 2:4] = f16(spread / 32.0, n)
        elif qtype == T.Q6_K:                       # d * sc * (q - 32), int8 sc, q < 64
            raw[:, 208:210] = f16(spread / 1350.0, n)
        else:
            raise ValueError(f"no random blocks for {qtype.name}")
        return raw.reshape(n_out, n_in // values * size)

    def matrix_type(name: str, layer: int):
        if shape.mix == "q4_0":
            return T.Q4_0
        six = name in ("attn_v", "ffn_down") and more_bits(layer, shape.n_layers)
        return T.Q6_K if six else T.Q4_K

    kv_width = shape.n_head_kv * head_dim
    base = T.Q4_0 if shape.mix == "q4_0" else T.Q4_K
    writer.add_tensor("token_embd.weight", blocks(base, shape.n_vocab, shape.n_embd), raw_dtype=base)
    for i in range(shape.n_layers):
        p = f"blk.{i}."
        for name, (n_out, n_in) in [("attn_q", (shape.n_embd, shape.n_embd)), ("attn_k", (kv_width, shape.n_embd)),
                                    ("attn_v", (kv_width, shape.n_embd)), ("attn_output", (shape.n_embd, shape.n_embd)),
                                    ("ffn_gate", (shape.n_ff, shape.n_embd)), ("ffn_up", (shape.n_ff, shape.n_embd)),
                                    ("ffn_down", (shape.n_embd, shape.n_ff))]:
            qtype = matrix_type(name, i)
            writer.add_tensor(p + name + ".weight", blocks(qtype, n_out, n_in), raw_dtype=qtype)
        writer.add_tensor(p + "attn_norm.weight", np.ones(shape.n_embd, dtype=np.float32))
        writer.add_tensor(p + "ffn_norm.weight", np.ones(shape.n_embd, dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(shape.n_embd, dtype=np.float32))
    if shape.mix == "q4_k_m":                       # Q4_K_M's head is Q6_K; a q4_0 model ties it to the embedding
        writer.add_tensor("output.weight", blocks(T.Q6_K, shape.n_vocab, shape.n_embd), raw_dtype=T.Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def resolve(model) -> Path:
    """A synthetic model's path (written into the model cache the first time), or
    localrun.models.resolve_model(model) for anything else."""
    from localrun.models import models_dir, resolve_model

    if str(model) not in SYNTHETIC:
        return resolve_model(model)
    path = models_dir() / "synthetic" / f"{model}.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        write_llama(partial, SYNTHETIC[str(model)])
        partial.replace(path)
    return path


if __name__ == "__main__":
    for name in sys.argv[1:] or list(SYNTHETIC):
        print(resolve(name))
