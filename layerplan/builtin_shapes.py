"""Built-in shapes of popular models, so a model can be planned before it is downloaded.

`profile_builtin("llama3.1-8b:q4_k_m")` builds the same ModelProfile a GGUF of that model
would give: the published hyper-parameters, and each tensor typed the way llama.cpp's
quantizer types it (Q4_K_M keeps the output head in Q6_K and gives half the attn_v and
ffn_down tensors Q6_K), so the bits per weight are the ones the files really use.
"""
from __future__ import annotations

from dataclasses import dataclass

from layerplan.ggml_types import GGML_TYPES_BY_NAME, tensor_bytes
from layerplan.model_profile import LayerProfile, ModelProfile


@dataclass(frozen=True)
class ModelShape:
    name: str
    architecture: str
    n_layers: int
    d_model: int
    n_head: int
    n_kv_head: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    hf_repo: str                 # the model's original repository name, for `--emit vllm`
    tied_embeddings: bool = False
    qkv_bias: bool = False       # qwen2
    post_norms: bool = False     # gemma2: norms after attention and after the FFN too
    sliding_window: int | None = None  # gemma2: every other layer attends to the last 4096 tokens
    rope_freqs: bool = False     # llama 3.1 ships a rope_freqs tensor
    is_70b: bool = False         # llama.cpp's quantizer gives 70B attn_v more bits
    n_expert: int = 0            # MoE: routed experts per layer (every layer is MoE, no dense FFN)
    n_expert_used: int = 0       # MoE: experts per token
    n_ff_expert: int = 0         # MoE: one expert's FFN width
    qk_norm: bool = False        # qwen3: RMSNorm over each Q and K head (two head_dim vectors)
    gpt_oss: bool = False        # biases on q/k/v/o, the router and the experts; attention sinks
    default_mix: str = "q4_k_m"  # the quantization a bare name means

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0


SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    ModelShape("llama2-7b", "llama", 32, 4096, 32, 32, 128, 11008, 32000, 4096, "meta-llama/Llama-2-7b-chat-hf"),
    ModelShape("llama3.1-8b", "llama", 32, 4096, 32, 8, 128, 14336, 128256, 131072,
               "meta-llama/Llama-3.1-8B-Instruct", rope_freqs=True),
    ModelShape("llama3.1-70b", "llama", 80, 8192, 64, 8, 128, 28672, 128256, 131072,
               "meta-llama/Llama-3.1-70B-Instruct", rope_freqs=True, is_70b=True),
    ModelShape("mistral-7b", "llama", 32, 4096, 32, 8, 128, 14336, 32768, 32768, "mistralai/Mistral-7B-Instruct-v0.3"),
    ModelShape("qwen2.5-7b", "qwen2", 28, 3584, 28, 4, 128, 18944, 152064, 32768, "Qwen/Qwen2.5-7B-Instruct",
               qkv_bias=True),
    ModelShape("qwen2.5-14b", "qwen2", 48, 5120, 40, 8, 128, 13824, 152064, 32768, "Qwen/Qwen2.5-14B-Instruct",
               qkv_bias=True),
    ModelShape("qwen2.5-32b", "qwen2", 64, 5120, 40, 8, 128, 27648, 152064, 32768, "Qwen/Qwen2.5-32B-Instruct",
               qkv_bias=True),
    ModelShape("gemma2-9b", "gemma2", 42, 3584, 16, 8, 256, 14336, 256000, 8192, "google/gemma-2-9b-it",
               tied_embeddings=True, post_norms=True, sliding_window=4096),
    # MoE (hyper-parameters from each model's config.json; every layer routes to experts)
    ModelShape("qwen3-30b-a3b", "qwen3moe", 48, 2048, 32, 4, 128, 0, 151936, 40960, "Qwen/Qwen3-30B-A3B",
               n_expert=128, n_expert_used=8, n_ff_expert=768, qk_norm=True),
    ModelShape("gpt-oss-20b", "gpt-oss", 24, 2880, 64, 8, 64, 0, 201088, 131072, "openai/gpt-oss-20b",
               sliding_window=128, n_expert=32, n_expert_used=4, n_ff_expert=2880, gpt_oss=True,
               default_mix="mxfp4"),
    ModelShape("mixtral-8x7b", "llama", 32, 4096, 32, 8, 128, 0, 32000, 32768, "mistralai/Mixtral-8x7B-Instruct-v0.1",
               n_expert=8, n_expert_used=2, n_ff_expert=14336),
)}

# quantization mix -> the base tensor type llama.cpp's quantizer starts from
MIXES = {"f32": "f32", "f16": "f16", "bf16": "bf16", "q8_0": "q8_0", "q6_k": "q6_k", "q5_k_m": "q5_k",
         "q5_k_s": "q5_k", "q5_1": "q5_1", "q5_0": "q5_0", "q4_k_m": "q4_k", "q4_k_s": "q4_k",
         "q4_1": "q4_1", "q4_0": "q4_0", "q3_k_m": "q3_k", "q2_k": "q2_k",
         "mxfp4": "q8_0"}  # llama.cpp's MXFP4_MOE: routed experts in mxfp4, every other matrix in q8_0
MOE_ONLY_MIXES = ("mxfp4",)
DEFAULT_MIX = "q4_k_m"
_EIGHT_EXPERT_ATTN_OUTPUT_Q5_K = ("q2_k", "q3_k_m", "q4_k_s", "q4_k_m")
_FALLBACK = {"q2_k": "iq4_nl", "q3_k": "iq4_nl", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(mix: str, role: str, layer: int, shape: ModelShape, n_cols: int) -> str:
    """The type llama.cpp's quantizer gives a tensor (`role` as in blk.N.<role>.weight) for `mix`.
    Expert tensors (ffn_down_exps) are typed like their dense role (ffn_down), as llama.cpp does;
    8-expert models (Mixtral) get q8_0 attn_k/attn_v and q5_k attn_output."""
    base = MIXES[mix]
    if shape.gpt_oss and role.endswith("_exps"):
        return "mxfp4"  # released in mxfp4: converters and quantizers keep its experts as they are
    if mix in ("f32", "f16", "bf16"):
        return base
    if mix == "mxfp4":
        return "mxfp4" if role.endswith("_exps") else "q8_0"
    role = role.removesuffix("_exps")
    n = shape.n_layers
    kind = base
    if shape.n_expert == 8 and role in ("attn_k", "attn_v"):
        kind = "q8_0"
    elif shape.n_expert == 8 and role == "attn_output":
        kind = "q5_k" if mix in _EIGHT_EXPERT_ATTN_OUTPUT_Q5_K else base
    elif role == "output" or (role == "token_embd" and shape.tied_embeddings):
        kind = "q8_0" if base == "q8_0" else "q6_k"
    elif role == "token_embd":
        kind = base
    elif role == "attn_v":
        if mix == "q2_k":
            kind = "q4_k" if shape.n_head // shape.n_kv_head >= 4 else "q3_k"
        elif mix == "q3_k_m":
            kind = "q5_k" if layer < 2 else "q4_k"
        elif mix in ("q4_k_m", "q5_k_m") and _use_more_bits(layer, n):
            kind = "q6_k"
        elif mix == "q4_k_s" and layer < 4:
            kind = "q5_k"
        if shape.is_70b and kind in ("q3_k", "q4_k"):
            kind = "q5_k"
    elif role == "ffn_down":
        if mix == "q2_k":
            kind = "q3_k"
        elif mix == "q3_k_m":
            kind = "q5_k" if layer < n // 16 else "q4_k"
        elif mix in ("q4_k_m", "q5_k_m") and _use_more_bits(layer, n):
            kind = "q6_k"
        elif mix == "q4_k_s" and layer < n // 8:
            kind = "q5_k"
    elif role == "attn_output":
        if mix == "q2_k":
            kind = "q3_k"
        elif mix == "q3_k_m":
            kind = "q4_k"
    if n_cols % GGML_TYPES_BY_NAME[kind].block_size:
        kind = _FALLBACK.get(kind, "q8_0")
    return kind


def _bytes(kind: str, n_cols: int, n_rows: int) -> int:
    return tensor_bytes(GGML_TYPES_BY_NAME[kind].id, (n_cols, n_rows))


def _moe_layer(shape: ModelShape, mix: str, il: int) -> LayerProfile:
    """A layer whose FFN is n_expert routed experts (ffn_{gate,up,down}_exps) and an f32 router."""
    d, q_dim, kv_dim = shape.d_model, shape.n_head * shape.head_dim, shape.n_kv_head * shape.head_dim
    attention = {"attn_q": (d, q_dim), "attn_k": (d, kv_dim), "attn_v": (d, kv_dim), "attn_output": (q_dim, d)}
    experts = {"ffn_gate_exps": (d, shape.n_ff_expert), "ffn_up_exps": (d, shape.n_ff_expert),
               "ffn_down_exps": (shape.n_ff_expert, d)}
    attention_bytes = sum(_bytes(tensor_type(mix, role, il, shape, cols), cols, rows)
                          for role, (cols, rows) in attention.items())
    expert_bytes = shape.n_expert * sum(_bytes(tensor_type(mix, role, il, shape, cols), cols, rows)
                                        for role, (cols, rows) in experts.items())
    router = 4 * d * shape.n_expert  # ffn_gate_inp stays f32
    vector_bytes = 4 * d * 2 + (4 * 2 * shape.head_dim if shape.qk_norm else 0)
    if shape.gpt_oss:  # q/k/v/o biases, attention sinks, router bias; the expert biases count as expert bytes
        vector_bytes += 4 * (q_dim + 2 * kv_dim + d + shape.n_head + shape.n_expert)
        expert_bytes += 4 * shape.n_expert * (2 * shape.n_ff_expert + d)
    expert_params = shape.n_expert * sum(c * r for c, r in experts.values())
    return LayerProfile(
        index=il, weight_bytes=attention_bytes + expert_bytes + router + vector_bytes,
        params=sum(c * r for c, r in attention.values()) + d * shape.n_expert + expert_params,
        expert_bytes=expert_bytes, expert_params=expert_params, vector_bytes=vector_bytes,
        n_matmuls=4 + 1 + 3, n_expert_matmuls=3,
        n_head=shape.n_head, n_kv_head=shape.n_kv_head, head_dim_k=shape.head_dim, head_dim_v=shape.head_dim,
        sliding_window=shape.sliding_window if shape.sliding_window and il % 2 == 0 else None,
    )


def _layer(shape: ModelShape, mix: str, il: int) -> LayerProfile:
    if shape.is_moe:
        return _moe_layer(shape, mix, il)
    d, q_dim, kv_dim = shape.d_model, shape.n_head * shape.head_dim, shape.n_kv_head * shape.head_dim
    matrices = {  # role: (n_cols = input features, n_rows = output features)
        "attn_q": (d, q_dim), "attn_k": (d, kv_dim), "attn_v": (d, kv_dim), "attn_output": (q_dim, d),
        "ffn_gate": (d, shape.n_ff), "ffn_up": (d, shape.n_ff), "ffn_down": (shape.n_ff, d),
    }
    weight_bytes = sum(_bytes(tensor_type(mix, role, il, shape, cols), cols, rows)
                       for role, (cols, rows) in matrices.items())
    n_norms = 4 if shape.post_norms else 2
    vector_bytes = 4 * d * n_norms + (4 * (q_dim + 2 * kv_dim) if shape.qkv_bias else 0)
    return LayerProfile(
        index=il, weight_bytes=weight_bytes + vector_bytes, params=sum(c * r for c, r in matrices.values()),
        vector_bytes=vector_bytes,
        n_head=shape.n_head, n_kv_head=shape.n_kv_head, head_dim_k=shape.head_dim, head_dim_v=shape.head_dim,
        sliding_window=shape.sliding_window if shape.sliding_window and il % 2 == 0 else None,
    )


def parse_shape_name(text: str) -> tuple[ModelShape, str] | None:
    """'llama3.1-8b:q4_k_m' -> (shape, 'q4_k_m'); None when `text` names no built-in shape."""
    name, _, mix = text.strip().lower().partition(":")
    if name not in SHAPES:
        return None
    shape = SHAPES[name]
    mix = mix or shape.default_mix
    if mix not in MIXES or (mix in MOE_ONLY_MIXES and not shape.is_moe):
        known = [m for m in MIXES if shape.is_moe or m not in MOE_ONLY_MIXES]
        raise ValueError(f"unknown quantization '{mix}' for {name}; use one of {', '.join(known)}")
    return shape, mix


def profile_builtin(text: str) -> ModelProfile:
    """Profile of a built-in shape, e.g. 'llama2-7b:f16' (the quantization defaults to q4_k_m)."""
    parsed = parse_shape_name(text)
    if parsed is None:
        raise ValueError(f"'{text}' is not a built-in shape; known: {', '.join(SHAPES)}")
    shape, mix = parsed
    d, vocab = shape.d_model, shape.n_vocab
    embd_bytes = _bytes(tensor_type(mix, "token_embd", 0, shape, d), d, vocab)
    output_bytes = 4 * d  # output_norm
    if not shape.tied_embeddings:
        output_bytes += _bytes(tensor_type(mix, "output", 0, shape, d), d, vocab)
    return ModelProfile(
        name=f"{shape.name}:{mix}", architecture=shape.architecture, quantization=mix.upper(),
        n_layers=shape.n_layers, d_model=d, n_ff=shape.n_ff, n_vocab=vocab, n_ctx_train=shape.n_ctx_train,
        layers=tuple(_layer(shape, mix, il) for il in range(shape.n_layers)),
        embedding_bytes=embd_bytes, output_bytes=output_bytes,
        head_bytes=output_bytes + (embd_bytes if shape.tied_embeddings else 0),
        head_params=vocab * d, tied_embeddings=shape.tied_embeddings,
        other_bytes=4 * (shape.head_dim // 2) if shape.rope_freqs else 0,
        n_expert=shape.n_expert, n_expert_used=shape.n_expert_used,
        source="built-in",
    )
