"""Every option of a loaded model and its engine, in one place: `EngineConfig`.

`LLM(model, **options)` makes one from its keyword arguments, `localrun chat/generate/serve`
from their flags (localrun/cli/options.py), and `LLMEngine` reads it. Each option is checked
once, when the EngineConfig is made, with one sentence naming it, before any model loads;
sizes given as text ("4GiB") become byte counts here. Torch-free.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from layerplan.kv_cache import engine_kv_type
from localrun.errors import OptionError

if TYPE_CHECKING:
    import torch

# Admission (engine/scheduler.py): a request is admitted while the free blocks cover its prompt,
# the next DEFAULT_OUTPUT_RESERVE_TOKENS tokens of it and of every running sequence, and 1% of
# the pool (vLLM's watermark). 64 tokens are four blocks of 16: most chat replies' first
# seconds, and few enough that a generous budget never notices.
DEFAULT_OUTPUT_RESERVE_TOKENS = 64
DEFAULT_WATERMARK = 0.01

# LLMEngine's own keyword names (vLLM's) for the options they share with LLM
ENGINE_NAMES = {"max_num_seqs": "n_parallel", "max_model_len": "n_ctx", "policy": "scheduling",
                "watermark": "kv_watermark", "ram_cache_bytes": "cache_ram"}
ENGINE_DEFAULT_MAX_NUM_SEQS = 16        # LLMEngine(model) alone batches up to 16 sequences
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")    # torch's names; the model computes in one of these
PROMPT_MATHS = ("int8", "float32")      # how quantized weights multiply prompt rows (model/gguf_weight.py)
DEFAULT_PROMPT_MATH = "int8"


@dataclass(frozen=True)
class EngineConfig:
    # the model: context, compute, placement
    n_ctx: int | None = None          # tokens per sequence; None: min(the trained context, 4096), or for an
                                      # LLMEngine, the positions its model was built for
    n_threads: int | None = None      # CPU threads; None: the physical cores
    dtype: str | torch.dtype | None = None   # compute dtype (COMPUTE_DTYPES, by name or as a torch.dtype);
                                             # None: float32 (see api.default_dtype)
    quantized: bool | None = None     # keep Q4_0/Q4_1/Q4_K and Q8_0 weights quantized (torch's weight-only
                                      # kernels); None: yes, unless dtype="float32" is asked for or
                                      # LOCALRUN_REFERENCE=1 (localrun/executor.py)
    prompt_math: str = DEFAULT_PROMPT_MATH   # prompt rows times quantized weights: "int8" (activations rounded
                                      # to 8-bit blocks, as decode rows and llama.cpp: the faster) or
                                      # "float32" (the exact model to float32 rounding); model/gguf_weight.py
    n_gpu_layers: int | str | None = "auto"   # 'auto' (layerplan chooses; all-CPU without a GPU) or
                                              # llama.cpp's -ngl count
    # batching and the KV cache
    n_parallel: int = 4               # sequences decoded together (continuous batching)
    max_num_batched_tokens: int = 2048    # tokens per engine step: the prefill chunk budget
    enable_chunked_prefill: bool = True
    kv_type: str | None = None        # f32, bf16, f16, int8, fp8 (layerplan.kv_cache.ENGINE_KV; llama.cpp's names
                                      # for them too: q8_0 is int8); None: f16 for a float32 model, else the
                                      # compute dtype's (kv_cache.default_kv_type)
    kv_budget_bytes: int | str | None = None   # KV pool bytes ("2GiB"); None: the plan's, per device
    enable_prefix_caching: bool = True
    cache_ram: int | str | None = None    # host RAM ("4GiB") for prefix blocks the pool evicts, copied back on a
                                          # hit; None: min(4 GiB, 25% of free RAM) with the KV on a GPU, 0 (off)
                                          # on a CPU-only machine, where the pool is host memory already
    disk_cache: bool = False          # keep full prefix blocks on disk, for a later process (the CLI turns it on)
    cache_dir: str | os.PathLike | None = None   # None: $LOCALRUN_HOME/kv-cache
    cache_disk: int | str | None = None   # its bound ("20GiB"); None: 20 GiB or half the free space
    # admission (engine/scheduler.py)
    scheduling: str = "fcfs"          # "fcfs", or "cache_aware": the longest cached prefix first, no request
                                      # passed over more than 16 times
    output_reserve_tokens: int | None = None   # KV held for this many output tokens per request; None: 64;
                                               # 0 admits greedily (and preempts when the pool runs out)
    kv_watermark: float | None = None  # fraction of the pool kept free at admission; None: 0.01
    # raw prompts too long for the context
    context_shift: bool = False       # drop the oldest tokens after the first n_keep instead of refusing
    n_keep: int = 0
    # speculative decoding: output unchanged (exact at temperature 0, the same distribution otherwise)
    speculative: str | None = None    # "ngram" (prompt lookup), "self:N" (the model's first N layers), or a
                                      # draft model's .gguf path or catalog name (the same vocabulary)
    num_speculative_tokens: int = 4   # the most drafts per step
    speculative_adaptive: bool = True  # stop drafting for a request or a step when measured costs say so

    def __post_init__(self):
        for name, low in (("n_ctx", 2), ("n_threads", 1)):
            value = getattr(self, name)
            if value == 0:                  # as llama.cpp's -c 0 and -t 0: the default
                object.__setattr__(self, name, None)
            elif value is not None:
                _integer(name, value, low)
        _integer("n_parallel", self.n_parallel, 1)
        _integer("n_keep", self.n_keep, 0)
        from localrun.placement import parse_layer_count
        parse_layer_count(self.n_gpu_layers)
        if self.kv_type is not None:        # in the engine's words from here on
            try:
                object.__setattr__(self, "kv_type", engine_kv_type(self.kv_type))
            except ValueError as err:
                raise OptionError("kv_type", str(err)) from None
        if self.prompt_math not in PROMPT_MATHS:
            raise OptionError("prompt_math", f"prompt_math takes {' or '.join(PROMPT_MATHS)}, not {self.prompt_math!r}.")
        if self.dtype is not None and not _is_compute_dtype(self.dtype):
            raise OptionError("dtype", f"dtype takes {', '.join(COMPUTE_DTYPES)}, not {self.dtype!r}.")
        for name, allow_zero in (("kv_budget_bytes", False), ("cache_disk", False), ("cache_ram", True)):
            object.__setattr__(self, name, parse_size(getattr(self, name), name, allow_zero))
        if self.output_reserve_tokens is None:
            object.__setattr__(self, "output_reserve_tokens", DEFAULT_OUTPUT_RESERVE_TOKENS)
        if self.kv_watermark is None:
            object.__setattr__(self, "kv_watermark", DEFAULT_WATERMARK)
        self.scheduler_config()          # the admission and batching options' own checks
        if self.speculative is not None:
            object.__setattr__(self, "speculative", str(self.speculative))
            if self.speculative.startswith("self:") and not self.speculative[len("self:"):].isdigit():
                raise OptionError("speculative", f"speculative takes a self-draft as self:N with N a number of "
                                  f"layers, not {self.speculative!r}.")

    @classmethod
    def for_engine(cls, **options) -> EngineConfig:
        """An EngineConfig from LLMEngine's own keyword names (max_num_seqs, max_model_len,
        policy, watermark, ram_cache_bytes; the rest as here); max_num_seqs defaults to 16."""
        options.setdefault("max_num_seqs", ENGINE_DEFAULT_MAX_NUM_SEQS)
        known = {f.name for f in fields(cls)}
        renamed = {ENGINE_NAMES.get(k, k): v for k, v in options.items()}
        unknown = sorted(set(renamed) - known)
        if unknown:
            raise TypeError(f"LLMEngine got unexpected keyword arguments: {', '.join(unknown)}")
        return cls(**renamed)

    def scheduler_config(self, max_model_len: int | None = None):
        """The scheduler's share of the options (engine/scheduler.py checks them; its errors
        name the options as this config does)."""
        from localrun.engine.scheduler import SchedulerConfig
        try:
            return SchedulerConfig(max_num_seqs=self.n_parallel, max_num_batched_tokens=self.max_num_batched_tokens,
                                   enable_chunked_prefill=self.enable_chunked_prefill, policy=self.scheduling,
                                   max_model_len=max_model_len, output_reserve_tokens=self.output_reserve_tokens,
                                   watermark=self.kv_watermark)
        except OptionError as e:
            raise e.named(ENGINE_NAMES.get(e.option, e.option)) from None


def parse_size(value: int | str | None, name: str, allow_zero: bool = False) -> int | None:
    """A byte count given as an int or a string such as "4GiB"; None stays None."""
    if isinstance(value, str):
        from layerplan.units import parse_bytes
        try:
            value = parse_bytes(value)
        except ValueError:
            raise OptionError(name, f"{name} is {value!r}, which is not a size; write it like 24GiB, 16G or "
                              "512MiB.") from None
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 0 or (value == 0 and not allow_zero)):
        raise OptionError(name, f"{name} must be a {'non-negative' if allow_zero else 'positive'} size, "
                          f"got {value!r}.")
    return value


def _integer(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise OptionError(name, f"{name} must be an integer >= {low}, got {value!r}.")


def _is_compute_dtype(dtype) -> bool:
    """One of COMPUTE_DTYPES, by name ("bfloat16") or as torch's dtype (torch.bfloat16)."""
    if isinstance(dtype, str):
        return dtype in COMPUTE_DTYPES
    return str(dtype) in {f"torch.{name}" for name in COMPUTE_DTYPES}
