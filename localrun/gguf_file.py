"""Open and validate a GGUF model file from its header alone (torch-free, fast).

Everything the loader, the model and llama.cpp's vocabulary load later rely on is checked
here, so that a damaged or hostile file is one UserError sentence and never a traceback, an
allocation sized by the file, or a crash inside llama.cpp."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from gguf import GGMLQuantizationType as QT

from layerplan.ggml_types import GGML_TYPES
from layerplan.gguf_header import GGUFFormatError, GGUFHeader, TensorInfo, read_header
from layerplan.model_profile import ModelProfile, profile_from_header
from localrun.config import ModelConfig
from localrun.errors import UserError
from localrun.vocab_check import check_vocabulary

SUPPORTED_TYPES = (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1,
                   QT.Q4_K, QT.Q5_K, QT.Q6_K)

LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


@dataclass(frozen=True)
class GGUFModelFile:
    path: Path
    header: GGUFHeader
    config: ModelConfig
    tensors: dict[str, TensorInfo]    # by name; TensorInfo.offset is relative to header.data_offset
    profile: ModelProfile             # the planner's view of the same header (placement plans with it)


def open_gguf(path: str | os.PathLike) -> GGUFModelFile:
    """Read and validate a GGUF model's header; every problem becomes one UserError sentence."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    try:
        header = read_header(path)
    except GGUFFormatError as e:
        raise UserError(f"{path} is not a valid GGUF file: {e.detail}") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot be read as GGUF ({e})") from None
    tensors = {t.name: t for t in header.tensors}
    config = ModelConfig.from_header(header, tensors)
    try:   # the planner's own bounds; placement plans with this profile (one read of the header)
        profile = profile_from_header(header)
        check_vocabulary(header)
    except GGUFFormatError as e:
        raise UserError(f"{path}: {e.detail}") from None
    except ValueError as e:
        raise UserError(f"{path}: {e}") from None
    shapes = expected_shapes(config, "rope_freqs.weight" in tensors)
    for name, shape in shapes.items():
        info = tensors.get(name)
        if info is None:
            raise UserError(f"{path}: tensor '{name}' is missing")
        if info.shape != shape:
            raise UserError(f"{path}: tensor '{name}' has shape {list(info.shape)}; the metadata says "
                            f"{list(shape)}")
        if info.type_id not in _SUPPORTED_IDS:
            raise UserError(f"{path}: tensor '{name}' has type {type_name(info.type_id)}, which is not supported "
                            f"(supported: {', '.join(t.name for t in SUPPORTED_TYPES)})")
    return GGUFModelFile(path, header, config, tensors, profile)


_SUPPORTED_IDS = frozenset(int(t) for t in SUPPORTED_TYPES)


def type_name(type_id: int) -> str:
    """llama.cpp's name of a tensor type ("Q4_K"); the header reader admits only known ids."""
    return GGML_TYPES[type_id].name.upper()


def expected_shapes(c: ModelConfig, has_rope_freqs: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor the model reads, with its shape in GGUF order (row length first)."""
    shapes = {"token_embd.weight": (c.n_embd, c.n_vocab), "output_norm.weight": (c.n_embd,)}
    if not c.tied_output:
        shapes["output.weight"] = (c.n_embd, c.n_vocab)
    if has_rope_freqs:
        shapes["rope_freqs.weight"] = (c.rope_dim // 2,)
    layer = c.arch.layer_shapes(n_embd=c.n_embd, n_head=c.n_head, n_head_kv=c.n_head_kv, head_dim=c.head_dim,
                                n_ff=c.n_ff)     # the family's tensors (layerplan/architectures.py)
    for i in range(c.n_layers):
        shapes.update({f"blk.{i}.{name}": shape for name, shape in layer.items()})
    return shapes
