"""What the user asks a plan for: context, parallel sequences, KV type, batch, margin."""
from __future__ import annotations

from dataclasses import dataclass

from layerplan.kv_cache import DEFAULT_KV_TYPE, LLAMA_CPP, EngineKVType, KVType, kv_spec
from layerplan.units import MiB

DEFAULT_CTX = 4096          # per sequence, when the model was trained for at least that
DEFAULT_UBATCH = 512        # llama.cpp's -ub: tokens per prefill step
DEFAULT_MARGIN = 512 * MiB  # kept free on every device
DEFAULT_PROMPT_TOKENS = 512


@dataclass(frozen=True)
class PlanSettings:
    n_ctx: int                      # context per sequence, in tokens
    n_parallel: int = 1             # sequences decoding together, each with n_ctx tokens of KV cache
    kv_type: str = DEFAULT_KV_TYPE  # a name in `runtime`'s vocabulary (kv_cache.kv_spec)
    n_ubatch: int = DEFAULT_UBATCH  # prefill tokens per step; sizes the compute buffers
    margin_bytes: int = DEFAULT_MARGIN
    kv_offload: bool = True         # True: a layer's KV cache lives on its layer's device (llama.cpp's
                                    # default); False: all KV cache in host memory (llama.cpp's -nkvo)
    flash_attention: bool = True    # no n_ctx x n_ctx score matrices in the compute buffers
    runtime: str = LLAMA_CPP        # whose KV layouts size the cache: "llama.cpp" (its block types, and
                                    # vLLM's fp8: plans to --emit) or "localrun" (the engine's pool)

    def __post_init__(self):
        kv_spec(self.kv_type, self.runtime)  # raises ValueError for a type the runtime cannot run
        if self.n_ctx < 1 or self.n_parallel < 1 or self.n_ubatch < 1 or self.margin_bytes < 0:
            raise ValueError("n_ctx, n_parallel and n_ubatch must be positive, the margin not negative")

    @property
    def kv(self) -> EngineKVType | KVType:
        """The KV type's layout, as the plan's runtime stores it."""
        return kv_spec(self.kv_type, self.runtime)

    @property
    def n_kv_tokens(self) -> int:
        """Token slots of KV cache in all: n_ctx for each of n_parallel sequences."""
        return self.n_ctx * self.n_parallel
