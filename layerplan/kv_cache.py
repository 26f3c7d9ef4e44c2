"""KV cache sizes: bytes per token for each KV type, GQA- and sliding-window-aware.

One token's K and V in one layer hold n_kv_head * (head_dim_k + head_dim_v) values. Block
types use llama.cpp's block sizes (q8_0: 34 bytes per 32 values, q4_0: 18 per 32), so a
figure here is what llama.cpp allocates, not an idealised bits-per-value.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from layerplan.model_profile import LayerProfile, ModelProfile


@dataclass(frozen=True)
class KVType:
    name: str
    block_size: int       # values per block
    type_size: int        # bytes per block
    llama_cpp: str | None  # --cache-type-k/-v value, None when llama.cpp has no such cache type
    vllm: str | None       # --kv-cache-dtype value, None when vLLM has no such cache type

    def bytes_for(self, n_values: int) -> float:
        return n_values * self.type_size / self.block_size


KV_TYPES: dict[str, KVType] = {
    "f32": KVType("f32", 1, 4, "f32", "float32"),
    "f16": KVType("f16", 1, 2, "f16", "auto"),
    "bf16": KVType("bf16", 1, 2, "bf16", "bfloat16"),
    "q8_0": KVType("q8_0", 32, 34, "q8_0", None),
    "fp8": KVType("fp8", 1, 1, None, "fp8"),
    "q5_1": KVType("q5_1", 32, 24, "q5_1", None),
    "q5_0": KVType("q5_0", 32, 22, "q5_0", None),
    "q4_1": KVType("q4_1", 32, 20, "q4_1", None),
    "q4_0": KVType("q4_0", 32, 18, "q4_0", None),
    "iq4_nl": KVType("iq4_nl", 32, 18, "iq4_nl", None),
}
KV_ALIASES = {"int8": "q8_0", "fp16": "f16", "float16": "f16", "bfloat16": "bf16", "float32": "f32",
              "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}


# localrun's own engine (localrun/engine/paged_kv.py) stores KV in its own layouts: this is the
# one place their sizes are written down; the engine sizes its pool with it and the ledger
# plans with it (tests/test_kv_bytes_agree.py checks both against a real pool).
ENGINE_KV_TYPES = ("f32", "bf16", "f16", "int8", "fp8")
ENGINE_SCALE_GROUP = 32         # values per float32 scale along head_dim for per-token scales (q8_0's block)
ENGINE_SCALE_BYTES = 4


def engine_scale_group(head_dim: int) -> int:
    return ENGINE_SCALE_GROUP if head_dim % ENGINE_SCALE_GROUP == 0 else head_dim


def engine_kv_bytes_per_value(kv_type: str, head_dim: int, block_size: int) -> float:
    """Bytes one K or V value costs on average in localrun's KV pool, scales included: f32,
    bf16, f16 as stored; fp8 (K and V) and int8 V with one float32 scale per 32 values of a
    token's head; int8 K with one float32 scale per block per channel."""
    plain = {"f32": 4, "bf16": 2, "f16": 2}
    if kv_type in plain:
        return plain[kv_type]
    if kv_type not in ENGINE_KV_TYPES:
        raise ValueError(f"unknown engine KV type '{kv_type}'; use one of {', '.join(ENGINE_KV_TYPES)}")
    per_token = 1 + ENGINE_SCALE_BYTES / engine_scale_group(head_dim)
    if kv_type == "fp8":
        return per_token
    return (per_token + 1 + ENGINE_SCALE_BYTES / block_size) / 2     # int8: V per token, K per channel


def kv_type(name: str) -> KVType:
    """Look up a KV type by name ('f16', 'q8_0', 'int8' = q8_0's layout, 'fp8', ...)."""
    key = KV_ALIASES.get(name.lower(), name.lower())
    if key not in KV_TYPES:
        known = ", ".join(list(KV_TYPES) + list(KV_ALIASES))
        raise ValueError(f"unknown KV type '{name}'; use one of {known}")
    return KV_TYPES[key]


def layer_kv_bytes_per_token(layer: "LayerProfile", kv: KVType) -> float:
    """Bytes one token's K and V take in one layer."""
    return kv.bytes_for(layer.n_kv_head * layer.head_dim_k) + kv.bytes_for(layer.n_kv_head * layer.head_dim_v)


def kv_bytes_per_token(profile: "ModelProfile", kv: KVType | str = "f16") -> int:
    """Bytes one token's K and V take summed over all layers (ignoring sliding windows)."""
    kv = kv_type(kv) if isinstance(kv, str) else kv
    return round(sum(layer_kv_bytes_per_token(layer, kv) for layer in profile.layers))


def num_window_blocks(sliding_window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Blocks of the engine's pool for its sliding-window layers (localrun/engine/window_blocks.py),
    one that never limits the scheduler: every running sequence's window (plus a partly filled
    block on each side) and one step's new tokens."""
    per_sequence = -(-(sliding_window - 1) // block_size) + 2
    return max_num_seqs * per_sequence + -(-max_num_batched_tokens // block_size)


def layer_kv_tokens(layer: "LayerProfile", n_ctx: int, n_parallel: int) -> int:
    """Token slots a layer's cache holds: n_ctx per sequence, or the sliding window if smaller."""
    per_sequence = min(n_ctx, layer.sliding_window) if layer.sliding_window else n_ctx
    return per_sequence * n_parallel


def layer_kv_bytes(layer: "LayerProfile", kv: KVType, n_ctx: int, n_parallel: int) -> int:
    """Bytes of one layer's KV cache for n_parallel sequences of n_ctx tokens each."""
    return round(layer_kv_bytes_per_token(layer, kv) * layer_kv_tokens(layer, n_ctx, n_parallel))
