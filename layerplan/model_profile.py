"""A model's profile for planning: per-layer bytes and shapes, from a GGUF header alone.

No tensor data is read, so a 40 GB file is profiled in well under a second. Weight bytes
are the bytes the file stores (type block sizes times shapes), so the profile's total equals
the sum of the file's tensor sizes byte for byte.
"""
from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import dataclass

from layerplan.architectures import ARCHITECTURES, PLANNER_SWA_PATTERNS
from layerplan.gguf_header import GGUFFormatError, GGUFHeader, LongArray, TensorInfo, read_header
from layerplan.gguf_values import (DEFAULT_CONTEXT_LENGTH, MAX_CONTEXT, MAX_EXPERTS, MAX_HEADS, MAX_LAYERS,
                                   MAX_VOCAB, MAX_WIDTH, arch_int, arch_ints_per_layer)

# general.file_type -> llama.cpp's name for the quantization mix
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
              11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
              17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
              23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S",
              29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0",
              38: "MXFP4_MOE"}
# architectures whose layers alternate sliding-window and global attention: pattern length n
# means layers with (il % n) < n - 1 use the window (llama.cpp's set_swa_pattern)
SWA_PATTERNS = {**PLANNER_SWA_PATTERNS, **{a.name: a.swa_pattern for a in ARCHITECTURES.values() if a.swa_pattern}}
_BLOCK = re.compile(r"^blk\.(\d{1,6})\.")


@dataclass(frozen=True)
class LayerProfile:
    index: int
    weight_bytes: int        # bytes of every tensor of this layer, as stored
    params: int              # matrix elements (2 flops each per token), experts included
    expert_bytes: int = 0    # part of weight_bytes in MoE expert tensors
    expert_params: int = 0   # part of params in MoE expert tensors
    vector_bytes: int = 0    # part of weight_bytes in 1-D tensors (norms, biases), kept in f32 by runtimes
    n_matmuls: int = 7       # matmul calls per step (q, k, v, o, gate, up, down as llama.cpp runs them)
    n_expert_matmuls: int = 0  # part of n_matmuls on MoE expert tensors (ffn_gate/up/down_exps)
    n_head: int = 0
    n_kv_head: int = 0       # 0: this layer has no KV cache
    head_dim_k: int = 0
    head_dim_v: int = 0
    sliding_window: int | None = None  # tokens kept per sequence, None: the whole context


@dataclass(frozen=True)
class ModelProfile:
    name: str
    architecture: str
    quantization: str        # llama.cpp's name for the file's quantization mix ("Q4_K_M")
    n_layers: int
    d_model: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    layers: tuple[LayerProfile, ...]
    embedding_bytes: int     # token_embd: the input lookup table, always in host memory
    output_bytes: int        # output head tensors stored in the file (output.weight, output_norm)
    head_bytes: int          # what the output head occupies on its device (a copy of token_embd when tied)
    head_params: int         # n_vocab * d_model
    tied_embeddings: bool
    other_bytes: int = 0     # global tensors that are neither (rope_freqs, ...), kept in host memory
    n_expert: int = 0        # MoE: experts per layer (0: a dense model)
    n_expert_used: int = 0   # MoE: experts each token is routed to
    n_expert_shared: int = 0 # MoE: shared experts every token runs (ffn_*_shexp, counted as dense weights)
    path: str | None = None  # the GGUF file, None for a built-in shape
    source: str = "gguf"     # "gguf" or "built-in"

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0 and any(layer.expert_bytes for layer in self.layers)

    @property
    def expert_bytes(self) -> int:
        """Bytes of all routed-expert tensors (ffn_*_exps), as stored."""
        return sum(layer.expert_bytes for layer in self.layers)

    @property
    def active_expert_bytes(self) -> float:
        """Expert bytes one token reads: n_expert_used of n_expert experts in every layer."""
        return self.expert_bytes * self.n_expert_used / self.n_expert if self.is_moe else 0.0

    @property
    def active_params(self) -> float:
        """Matrix parameters one token multiplies by: dense layers, its routed experts, the output head."""
        used = self.n_expert_used / self.n_expert if self.is_moe else 1.0
        return (sum(layer.params - layer.expert_params * (1 - used) for layer in self.layers)
                + self.head_params)

    @property
    def weight_bytes(self) -> int:
        """All tensor bytes, as stored (equals the sum of the file's tensor sizes)."""
        return (sum(layer.weight_bytes for layer in self.layers) + self.embedding_bytes
                + self.output_bytes + self.other_bytes)

    @property
    def n_params(self) -> int:
        tied = 0 if self.tied_embeddings else self.head_params
        return sum(layer.params for layer in self.layers) + self.head_params + tied

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.weight_bytes / max(1, self.n_params)


def profile_gguf(path: str | os.PathLike) -> ModelProfile:
    """Profile the GGUF file at `path` from its header (no tensor data is read)."""
    return profile_from_header(read_header(path))


def _is_matrix(info: TensorInfo) -> bool:
    """A weight matrix some matmul reads (norms, biases and the per-expert biases of gpt-oss are not)."""
    return len(info.shape) >= 2 and not info.name.endswith(".bias")


def _params(info: TensorInfo) -> int:
    if not _is_matrix(info):
        return 0  # norms and biases: no matmul
    n = 1
    for dim in info.shape:
        n *= dim
    return n


def _layer_count(header: GGUFHeader, by_layer: dict) -> int:
    """block_count, bounded: every layer holds at least one of the file's tensors."""
    if f"{header.architecture}.block_count" not in header.metadata and not by_layer:
        raise ValueError(f"{header.path.name} has no transformer layers this planner understands")
    n_layers = arch_int(header, "block_count", max(by_layer, default=-1) + 1, low=1, high=MAX_LAYERS)
    if n_layers > len(header.tensors):
        raise GGUFFormatError(f"'{header.architecture}.block_count' is {n_layers:,}, more layers than the "
                              f"file's {len(header.tensors):,} tensors can make", header.path.name)
    return n_layers


def _embedding_width(header: GGUFHeader, globals_: dict) -> int:
    embd = globals_.get("token_embd.weight")
    d_model = arch_int(header, "embedding_length", embd.shape[0] if embd else 0, high=MAX_WIDTH)
    if not d_model:
        raise ValueError(f"{header.path.name} has no transformer layers this planner understands")
    return d_model


def profile_from_header(header: GGUFHeader) -> ModelProfile:
    """The profile of a parsed header; malformed or absurd metadata raises GGUFFormatError
    (a ValueError) with one sentence."""
    try:
        return _profile(header)
    except GGUFFormatError as err:
        raise GGUFFormatError(err.detail, header.path.name) from None


def _profile(header: GGUFHeader) -> ModelProfile:
    arch, meta = header.architecture, header.metadata
    by_layer: dict[int, list[TensorInfo]] = defaultdict(list)
    globals_: dict[str, TensorInfo] = {}
    for info in header.tensors:
        match = _BLOCK.match(info.name)
        if match:
            by_layer[int(match.group(1))].append(info)
        else:
            globals_[info.name] = info
    n_layers, d_model = _layer_count(header, by_layer), _embedding_width(header, globals_)
    n_head = arch_ints_per_layer(header, "attention.head_count", n_layers, high=MAX_HEADS)
    if not max(n_head):
        raise GGUFFormatError(f"'{arch}.attention.head_count' is 0 in every layer", header.path.name)
    n_kv_head = arch_ints_per_layer(header, "attention.head_count_kv", n_layers, n_head, high=MAX_HEADS)
    n_ff = max(arch_ints_per_layer(header, "feed_forward_length", n_layers, 0, high=MAX_WIDTH))
    head_dim_k = arch_int(header, "attention.key_length", max(1, d_model // max(n_head)), low=1, high=MAX_WIDTH)
    head_dim_v = arch_int(header, "attention.value_length", head_dim_k, low=1, high=MAX_WIDTH)
    window = arch_int(header, "attention.sliding_window", 0, high=MAX_CONTEXT)
    pattern = SWA_PATTERNS.get(arch)
    embd = globals_.get("token_embd.weight")

    layers = []
    for il in range(n_layers):
        tensors = by_layer.get(il, [])
        experts = [t for t in tensors if "_exps" in t.name]
        is_swa = bool(window) and pattern is not None and il % pattern < pattern - 1
        layers.append(LayerProfile(
            index=il,
            weight_bytes=sum(t.n_bytes for t in tensors),
            params=sum(_params(t) for t in tensors),
            expert_bytes=sum(t.n_bytes for t in experts),
            expert_params=sum(_params(t) for t in experts),
            vector_bytes=sum(t.n_bytes for t in tensors if len(t.shape) < 2),
            n_matmuls=sum(1 for t in tensors if _is_matrix(t)),
            n_expert_matmuls=sum(1 for t in experts if _is_matrix(t)),
            n_head=n_head[il], n_kv_head=n_kv_head[il], head_dim_k=head_dim_k, head_dim_v=head_dim_v,
            sliding_window=int(window) if is_swa else None,
        ))
    stray = [t for il, ts in by_layer.items() if il >= n_layers for t in ts]  # e.g. next-token-prediction layers

    tokens = meta.get("tokenizer.ggml.tokens")
    n_vocab = (arch_int(header, "vocab_size", 0, high=MAX_VOCAB)
               or (len(tokens) if isinstance(tokens, (list, LongArray)) else 0)
               or (embd.shape[1] if embd and len(embd.shape) > 1 else 0))
    output = globals_.get("output.weight")
    head_names = {"output.weight", "output_norm.weight", "output_norm.bias", "output.bias"}
    output_bytes = sum(t.n_bytes for name, t in globals_.items() if name in head_names)
    embedding_bytes = embd.n_bytes if embd else 0
    other_bytes = sum(t.n_bytes for name, t in globals_.items()
                      if name not in head_names and name != "token_embd.weight") + sum(t.n_bytes for t in stray)
    tied = output is None
    file_type = meta.get("general.file_type")
    n_expert = arch_int(header, "expert_count", 0, high=MAX_EXPERTS)
    return ModelProfile(
        name=str(meta.get("general.name") or header.path.stem),
        architecture=arch,
        quantization=FILE_TYPES.get(file_type, "unknown") if type(file_type) is int else "unknown",
        n_layers=n_layers, d_model=d_model, n_ff=n_ff, n_vocab=n_vocab,
        n_ctx_train=arch_int(header, "context_length", DEFAULT_CONTEXT_LENGTH, low=1, high=MAX_CONTEXT),
        layers=tuple(layers),
        embedding_bytes=embedding_bytes,
        output_bytes=output_bytes,
        head_bytes=output_bytes + (embedding_bytes if tied else 0),
        head_params=n_vocab * d_model,
        tied_embeddings=tied,
        other_bytes=other_bytes,
        n_expert=n_expert,
        n_expert_used=arch_int(header, "expert_used_count", 0, high=n_expert),
        n_expert_shared=arch_int(header, "expert_shared_count", 0, high=MAX_EXPERTS),
        path=str(header.path),
    )
