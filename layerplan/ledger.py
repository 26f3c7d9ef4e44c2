"""The memory ledger of localrun's engine: every part of a plan's memory, per device, as the engine
holds it (not as the file stores it).

- Weights: on the CPU, a matrix whose type localrun's kernels multiply in place (ENGINE_KERNEL_TYPES)
  stays in the file's memory map: its pages count as resident once a forward touches them, but
  they are file-backed, shared with other processes and reclaimable (`mapped`). Every other
  matrix is copied: dequantized to the compute dtype, or on a GPU packed as int4 (Q4_0/Q4_1/Q4_K:
  half a byte per value plus, per 32, a bf16 scale and zero and their bf16 rounding residuals:
  localrun.model.quant.Int4Weight) or int8 (Q8_0: a byte per value plus a row's scale in f32
  and bf16: Int8Weight). Norms and biases are f32 copies. A tied output head on a GPU is a copy
  of the token table.
- The KV pool per device: the engine reserves n_parallel x ctx tokens in blocks of 16 with
  torch.empty, so its pages are committed as tokens are written; the ledger counts the whole
  pool (what a filled context holds). Sliding-window layers have a pool of their own, sized by
  the window and the prompt step (engine_kv_tokens).
- Compute buffers (layerplan.buffers), but for the output head's: the engine projects only the
  rows it samples (one per sequence), not a whole prompt step's.
- The CUDA runtime, where a GPU holds layers: on each such GPU, what a torch process holds beyond
  its allocator's (context, cuBLAS workspace, the kernels' modules loaded as the engine first
  calls them), and on the host, what the engine's GPU path adds to the process's RSS beyond
  torch's CUDA set-up. Both measured with scripts/gpu_check.py (2026-12-04; one H200, torch
  2.11 with CUDA 13, NVML and RSS): 0.668 GiB on the GPU in each of 4 runs (0.667-0.668), 0.39
  to 0.46 GiB on the host; layerplan's CUDA_CONTEXT_BYTES (384 MiB) is llama.cpp's, whose
  context loads far fewer kernels.
- The tokenizer on the host: llama.cpp's vocabulary (token texts, scores, maps, BPE merge ranks)
  and localrun's two piece tables. Measured with llama-cpp-python 0.3.36 (2026-12-01): 172 bytes
  per token and 203 per merge in llama.cpp, 93 per token for the piece tables (SmolLM2-135M:
  22.5 MB measured; gemma-3-270m: 72.1 MB measured, 68.9 MB from these figures).
- A draft model (its own weights and KV pool, on the host), and the RAM KV tier (its byte cap).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from layerplan.buffers import CUDA_CONTEXT_BYTES, head_buffer_bytes
from layerplan.ggml_types import GGML_TYPES_BY_NAME
from layerplan.gguf_header import GGUFHeader, LongArray, TensorInfo, read_header
from layerplan.kv_cache import KV_BLOCK_SIZE, engine_kv, layer_kv_tokens, num_window_blocks
from layerplan.model_profile import ModelProfile

# GGML types localrun's compiled kernels multiply in place (localrun/kernels derives its KERNEL_TYPES from this)
ENGINE_KERNEL_TYPES = frozenset({"q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k"})
INT4_TYPES, INT8_TYPES = frozenset({"q4_0", "q4_1", "q4_k"}), frozenset({"q8_0"})
ENGINE_CUDA_CONTEXT_BYTES = 684 * 2**20     # per GPU holding layers (module docstring: measured)
ENGINE_CUDA_HOST_BYTES = 420 * 2**20        # on the host, once any GPU holds layers
GROUP = 32
TOKENIZER_BYTES_PER_TOKEN = 172 + 93   # llama.cpp's vocabulary + localrun's piece tables
TOKENIZER_BYTES_PER_MERGE = 203
F32 = 4


@dataclass(frozen=True)
class EngineOptions:
    dtype_bytes: int = 4            # the compute dtype (float32 by default: localrun.api.default_dtype)
    kv_type: str | None = None      # the engine's KV type ("f16", "int8", ...: kv_cache.ENGINE_KV, its layout's
                                    # size, scales included); None: the plan's
    kernels: bool = True            # localrun's compiled kernels are loaded
    draft: ModelProfile | None = None
    ram_kv_tier_bytes: int = 0      # cache_ram: host RAM for evicted prefix blocks


@dataclass(frozen=True)
class LedgerItem:
    device: int        # index into machine.devices
    what: str
    n_bytes: int
    mapped: bool = False   # file-backed pages of the model file: shared and reclaimable


@dataclass(frozen=True)
class Ledger:
    devices: tuple        # machine.devices
    items: tuple[LedgerItem, ...]

    def device_bytes(self, device: int, *, mapped: bool | None = None) -> int:
        return sum(i.n_bytes for i in self.items if i.device == device and (mapped is None or i.mapped == mapped))

    def by_device(self) -> list[tuple[object, list[LedgerItem]]]:
        return [(d, [i for i in self.items if i.device == k]) for k, d in enumerate(self.devices)]


def _elements(info: TensorInfo) -> int:
    return math.prod(info.shape)


def held_bytes(info: TensorInfo, on_gpu: bool, options: EngineOptions) -> tuple[int, bool]:
    """(bytes, memory-mapped) of one tensor as localrun's engine holds it on a CPU or a GPU."""
    kind = next((t.name for t in GGML_TYPES_BY_NAME.values() if t.id == info.type_id), "?")
    if len(info.shape) < 2 or info.name.endswith(".bias"):
        return _elements(info) * F32, False
    n_cols, n_rows = info.shape[0], _elements(info) // info.shape[0]
    if not on_gpu and options.kernels and kind in ENGINE_KERNEL_TYPES and n_cols % GROUP == 0:
        return info.n_bytes, True
    if kind in INT4_TYPES and n_cols % GROUP == 0:    # codes; scale and zero, and their residuals, bf16
        return n_rows * n_cols // 2 + n_rows * (n_cols // GROUP) * 4 * 2, False
    if kind in INT8_TYPES:                            # codes; the row's scale, f32 and bf16
        return n_rows * n_cols + n_rows * (F32 + 2), False
    return _elements(info) * options.dtype_bytes, False


def _tokenizer_bytes(header: GGUFHeader | None, n_vocab: int) -> int:
    merges = header.metadata.get("tokenizer.ggml.merges") if header else None
    n_merges = len(merges) if isinstance(merges, (list, LongArray)) else 0
    return n_vocab * TOKENIZER_BYTES_PER_TOKEN + n_merges * TOKENIZER_BYTES_PER_MERGE


def _weight_items(plan, header: GGUFHeader, options: EngineOptions) -> dict[tuple[int, bool], int]:
    """{(device, mapped): bytes} of every tensor of the file on the device the plan gives it."""
    placement, host = plan.placement, len(plan.machine.gpus)
    totals: dict[tuple[int, bool], int] = {}

    def add(device: int, info: TensorInfo) -> None:
        n_bytes, mapped = held_bytes(info, device != host, options)
        totals[(device, mapped)] = totals.get((device, mapped), 0) + n_bytes

    names = {t.name: t for t in header.tensors}
    for info in header.tensors:
        if info.name.startswith("blk."):
            il = int(info.name.split(".")[1])
            add(placement.layer_devices[il] if il < len(placement.layer_devices) else host, info)
        elif info.name in ("output.weight", "output_norm.weight", "output_norm.bias", "output.bias"):
            add(placement.head_device, info)
        else:
            add(host, info)  # token_embd and other globals stay in host memory
    if "output.weight" not in names and "token_embd.weight" in names and placement.head_device != host:
        add(placement.head_device, names["token_embd.weight"])  # a tied head on a GPU: a copy of the table
    return totals


def engine_kv_tokens(layer, settings) -> int:
    """Token slots of a layer's KV that the engine's sequences fill: n_ctx each. A sliding-window
    layer's pool (num_window_blocks: the windows, a block either side, and one prompt step's
    tokens) keeps blocks that leave a window as prefix cache until it runs out of free ones, so
    sequences that fill their contexts commit up to the whole pool, not just their windows."""
    tokens = settings.n_ctx * settings.n_parallel
    if not layer.sliding_window:
        return tokens
    pool = num_window_blocks(layer.sliding_window, KV_BLOCK_SIZE, settings.n_parallel, settings.n_ubatch)
    return min(tokens, pool * KV_BLOCK_SIZE)


def engine_ledger(plan, options: EngineOptions = EngineOptions()) -> Ledger:
    """The ledger of `plan` (layerplan.Plan) for localrun's engine. Weights per tensor when the
    plan's profile comes from a GGUF file; for a built-in shape, the profile's bytes as stored."""
    profile, machine, placement, settings = plan.profile, plan.machine, plan.placement, plan.settings
    host, items = len(machine.gpus), []
    header = read_header(profile.path) if profile.path else None
    if header is not None:
        for (device, mapped), n_bytes in sorted(_weight_items(plan, header, options).items()):
            items.append(LedgerItem(device, "weights, memory-mapped" if mapped else "weights, copied", n_bytes, mapped))
    else:
        for k, usage in enumerate(placement.usage):
            if usage.weights_bytes:
                items.append(LedgerItem(k, "weights, as stored", usage.weights_bytes))
    layout = engine_kv(options.kv_type or settings.kv_type)

    def kv_bytes(layer, n_tokens: int) -> int:
        return round(layout.bytes_per_token(layer.n_kv_head, layer.head_dim_k, layer.head_dim_v, KV_BLOCK_SIZE)
                     * n_tokens)

    kv = [0] * len(machine.devices)
    for il, layer in enumerate(profile.layers):
        kv[placement.kv_devices[il]] += kv_bytes(layer, engine_kv_tokens(layer, settings))
    for k, n_bytes in enumerate(kv):
        if n_bytes:
            items.append(LedgerItem(k, f"KV pool ({settings.n_ctx} x {settings.n_parallel} tokens)", n_bytes))
    gpus_in_use = {k for k, usage in enumerate(placement.usage) if k != host and usage.buffer_bytes}
    for k, usage in enumerate(placement.usage):
        buffers = usage.buffer_bytes - (CUDA_CONTEXT_BYTES if k in gpus_in_use else 0)   # the plan counts its own
        if k == placement.head_device and buffers:
            # the plan sizes the head's buffer as llama.cpp reserves it, logits for a whole ubatch
            # (2 GiB for a 262k vocabulary at 2048 tokens); the engine projects only the rows it
            # samples, one per sequence, into logits the host's buffers already count
            buffers -= head_buffer_bytes(profile, settings)
            if k != host:     # on a GPU: computed there, then copied to the host's
                buffers += settings.n_parallel * profile.n_vocab * F32
        if buffers:
            items.append(LedgerItem(k, "compute buffers", buffers))
        if k in gpus_in_use:
            items.append(LedgerItem(k, "CUDA context, cuBLAS and kernels", ENGINE_CUDA_CONTEXT_BYTES))
    if gpus_in_use:
        items.append(LedgerItem(host, "CUDA runtime (host side)", ENGINE_CUDA_HOST_BYTES))
    items.append(LedgerItem(host, "tokenizer (vocabulary and tables)", _tokenizer_bytes(header, profile.n_vocab)))
    if options.draft is not None:
        draft = options.draft
        draft_kv = sum(kv_bytes(l, layer_kv_tokens(l, settings.n_ctx, settings.n_parallel)) for l in draft.layers)
        items.append(LedgerItem(host, f"draft model {draft.name} (weights and KV)", draft.weight_bytes + draft_kv))
    if options.ram_kv_tier_bytes:
        items.append(LedgerItem(host, "RAM KV tier (cap)", options.ram_kv_tier_bytes))
    return Ledger(machine.devices, tuple(items))
