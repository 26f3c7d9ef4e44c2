"""Open and validate a GGUF model file from its header alone (torch-free, fast)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from gguf import GGMLQuantizationType as QT

from layerplan.gguf_header import GGUFFormatError, GGUFHeader, TensorInfo, read_header
from localrun.config import ModelConfig
from localrun.errors import UserError

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


def open_gguf(path: str | os.PathLike) -> GGUFModelFile:
    """Read and validate a GGUF model's header; every problem becomes one UserError sentence."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    try:
        header = read_header(path)
    except GGUFFormatError as e:
        raise UserError(f"{path}: not a valid GGUF file ({e})") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot be read as GGUF ({e})") from None
    tensors = {t.name: t for t in header.tensors}
    for t in header.tensors:
        if header.data_offset + t.offset + t.n_bytes > header.file_bytes:
            raise UserError(f"{path}: the file is truncated (tensor '{t.name}' ends past the end of the file)")
    config = ModelConfig.from_header(header, tensors)
    required = ["token_embd.weight", "output_norm.weight"]
    required += [f"blk.{i}.{t}.weight" for i in range(config.n_layers) for t in LAYER_TENSORS]
    for name in required:
        if name not in tensors:
            raise UserError(f"{path}: tensor '{name}' is missing")
    for name, info in tensors.items():
        if name in required or name == "output.weight":
            qtype = QT(info.type_id)
            if qtype not in SUPPORTED_TYPES:
                raise UserError(f"{path}: tensor '{name}' has type {qtype.name}, which is not supported "
                                f"(supported: {', '.join(t.name for t in SUPPORTED_TYPES)})")
    return GGUFModelFile(path, header, config, tensors)


