"""KV cache sizes: bytes per token for each KV type, GQA- and sliding-window-aware.

One token's K and V in one layer hold n_kv_head * (head_dim_k + head_dim_v) values. Two sets of
layouts, each written down once here:
- localrun's engine (`ENGINE_KV`): the layouts of its paged pool (localrun/engine/paged_kv.py),
  scales included. The pool allocates with them and every plan for the engine (placement, the
  ledger, `localrun plan`) sizes with them; `engine_kv_type` is the one check of a --kv-type /
  kv_type value, `default_kv_type` the one default.
- llama.cpp's block types (`KV_TYPES`: q8_0 34 bytes per 32 values, q4_0 18 per 32, ...) and
  vLLM's fp8, for plans handed to those runtimes (`--emit llama-server`, `--emit vllm`): a figure
  there is what llama.cpp allocates, not an idealised bits-per-value.
A plan says whose layouts it uses (PlanSettings.runtime); `kv_spec` gives the one it means.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from layerplan.model_profile import LayerProfile, ModelProfile

LOCALRUN, LLAMA_CPP = "localrun", "llama.cpp"     # PlanSettings.runtime: whose KV layouts a plan sizes
RUNTIMES = (LOCALRUN, LLAMA_CPP)


# --- localrun's engine -----------------------------------------------------------------------------

KV_BLOCK_SIZE = 16            # tokens per block of the engine's pool (LLMEngine's block_size)
ENGINE_SCALE_GROUP = 32       # values per float32 scale along head_dim for per-token scales (q8_0's block)
ENGINE_SCALE_BYTES = 4        # scales are float32


def engine_scale_group(head_dim: int) -> int:
    """Values of a token's head that share one per-token scale: 32, or the whole head when
    head_dim is not a multiple of 32."""
    return ENGINE_SCALE_GROUP if head_dim % ENGINE_SCALE_GROUP == 0 else head_dim


@dataclass(frozen=True)
class EngineKVType:
    """One layout of the engine's KV pool: codes of `code_bytes` each, and for K and for V their
    float32 scales: None (values as stored), "token" (one per 32 values of a token's head, as
    llama.cpp's q8_0 blocks: paged_kv.TokenScaledStore) or "block" (one per block of tokens per
    channel, for keys, whose outlier channels would swamp a per-token scale: ChannelScaledStore)."""
    name: str
    code_bytes: int
    key_scales: str | None = None
    value_scales: str | None = None

    @property
    def quantized(self) -> bool:
        """Stored as codes with scales, widened to the compute dtype when read."""
        return self.key_scales is not None

    def bytes_for(self, n_values: int) -> float:
        """Bytes of n_values codes, scales left out: what the menu ranks precision by."""
        return n_values * self.code_bytes

    def _head_bytes(self, scales: str | None, head_dim: int, block_size: int) -> float:
        """Bytes of one token's key (or value) in one KV head: its codes and its share of the scales."""
        if scales is None:
            n_scales = 0
        elif scales == "token":
            n_scales = head_dim // engine_scale_group(head_dim)
        else:                                   # "block": one per channel, shared by block_size tokens
            n_scales = head_dim / block_size
        return head_dim * self.code_bytes + n_scales * ENGINE_SCALE_BYTES

    def key_bytes(self, head_dim: int, block_size: int = KV_BLOCK_SIZE) -> float:
        return self._head_bytes(self.key_scales, head_dim, block_size)

    def value_bytes(self, head_dim: int, block_size: int = KV_BLOCK_SIZE) -> float:
        return self._head_bytes(self.value_scales, head_dim, block_size)

    def bytes_per_token(self, n_kv_head: int, head_dim_k: int, head_dim_v: int,
                        block_size: int = KV_BLOCK_SIZE) -> float:
        """Bytes one token's K and V take in one layer of the pool, scales included."""
        return n_kv_head * (self.key_bytes(head_dim_k, block_size) + self.value_bytes(head_dim_v, block_size))


ENGINE_KV: dict[str, EngineKVType] = {
    "f32": EngineKVType("f32", 4),
    "bf16": EngineKVType("bf16", 2),
    "f16": EngineKVType("f16", 2),
    "int8": EngineKVType("int8", 1, key_scales="block", value_scales="token"),
    "fp8": EngineKVType("fp8", 1, key_scales="token", value_scales="token"),     # float8_e4m3fn
}
ENGINE_KV_TYPES = tuple(ENGINE_KV)
# other runtimes' names for the same layouts (llama.cpp's -ctk, vLLM's --kv-cache-dtype, torch's dtypes)
ENGINE_KV_ALIASES = {"q8_0": "int8", "fp16": "f16", "float16": "f16", "bfloat16": "bf16", "fp32": "f32",
                     "float32": "f32", "fp8_e4m3": "fp8"}
# the KV type of each compute dtype: f16 for a float32 model, as llama.cpp (half the bytes of f32, so
# twice the context or sequences per byte, and the paged kernel reads it in place); a 16-bit model
# stores what it computes. kv_type="f32" keeps a float32 model's KV exact.
DEFAULT_KV_TYPES = {"float32": "f16", "bfloat16": "bf16", "float16": "f16"}
DEFAULT_KV_TYPE = DEFAULT_KV_TYPES["float32"]     # the default compute dtype's (and llama.cpp's)


def engine_kv_type(name: str, option: str = "kv_type") -> str:
    """The engine's name of KV type `name` (an engine name, or another runtime's name for the same
    layout: q8_0 is int8); a name the engine cannot run raises ValueError with one sentence about
    `option`, naming the ones it can. The one check of a KV type, behind every door."""
    canonical = ENGINE_KV_ALIASES.get(name, name) if isinstance(name, str) else name
    if canonical not in ENGINE_KV:
        raise ValueError(f"{option} takes {', '.join(ENGINE_KV_TYPES)}, not {name!r}.")
    return canonical


def default_kv_type(compute_dtype="float32") -> str:
    """The engine's KV type for a model computing in `compute_dtype` (a name, or a torch.dtype)."""
    name = str(compute_dtype).removeprefix("torch.")
    if name not in DEFAULT_KV_TYPES:
        raise ValueError(f"no KV type is the default for a {name} model; pass kv_type")
    return DEFAULT_KV_TYPES[name]


def engine_kv(name: str) -> EngineKVType:
    """The layout of the engine's KV type `name` (checked by engine_kv_type)."""
    return ENGINE_KV[engine_kv_type(name)]


# --- llama.cpp's block types (and vLLM's fp8) --------------------------------------------------------

@dataclass(frozen=True)
class KVType:
    name: str
    block_size: int       # values per block
    type_size: int        # bytes per block
    llama_cpp: str | None  # --cache-type-k/-v value, None when llama.cpp has no such cache type
    vllm: str | None       # --kv-cache-dtype value, None when vLLM has no such cache type

    @property
    def quantized(self) -> bool:
        """Stored in blocks with scales (or as fp8), dequantized to f16 for a prefill step."""
        return self.block_size > 1 or self.name == "fp8"

    def bytes_for(self, n_values: int) -> float:
        return n_values * self.type_size / self.block_size

    def bytes_per_token(self, n_kv_head: int, head_dim_k: int, head_dim_v: int) -> float:
        """Bytes one token's K and V take in one layer."""
        return self.bytes_for(n_kv_head * head_dim_k) + self.bytes_for(n_kv_head * head_dim_v)


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


def kv_type(name: str) -> KVType:
    """Look up one of llama.cpp's (or vLLM's) KV types by name ('f16', 'q8_0', 'int8' = q8_0, 'fp8', ...)."""
    key = KV_ALIASES.get(name.lower(), name.lower())
    if key not in KV_TYPES:
        known = ", ".join(list(KV_TYPES) + list(KV_ALIASES))
        raise ValueError(f"unknown KV type '{name}'; use one of {known}")
    return KV_TYPES[key]


def kv_spec(name: str, runtime: str = LLAMA_CPP) -> EngineKVType | KVType:
    """KV type `name` as `runtime` lays it out: the engine's layout (LOCALRUN) or llama.cpp's
    (LLAMA_CPP, the one vLLM's names also resolve in). Raises ValueError for a name it cannot run."""
    if runtime == LOCALRUN:
        return engine_kv(name)
    if runtime != LLAMA_CPP:
        raise ValueError(f"runtime takes {' or '.join(RUNTIMES)}, not {runtime!r}")
    return kv_type(name)


# --- sizes of a model's cache ------------------------------------------------------------------------

def layer_kv_bytes_per_token(layer: "LayerProfile", kv: EngineKVType | KVType) -> float:
    """Bytes one token's K and V take in one layer."""
    return kv.bytes_per_token(layer.n_kv_head, layer.head_dim_k, layer.head_dim_v)


def kv_bytes_per_token(profile: "ModelProfile", kv: EngineKVType | KVType | str = DEFAULT_KV_TYPE) -> int:
    """Bytes one token's K and V take summed over all layers (ignoring sliding windows); a name
    is llama.cpp's type (kv_spec for the engine's)."""
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


def layer_kv_bytes(layer: "LayerProfile", kv: EngineKVType | KVType, n_ctx: int, n_parallel: int) -> int:
    """Bytes of one layer's KV cache for n_parallel sequences of n_ctx tokens each."""
    return round(layer_kv_bytes_per_token(layer, kv) * layer_kv_tokens(layer, n_ctx, n_parallel))
