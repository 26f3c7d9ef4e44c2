"""GGUF file -> (ModelConfig, weights).

`file_weights` gives every tensor the file's family uses as a `FileTensor`: a read-only
memory map of its bytes, converted only when the model builds the layer that needs it, so that
loading never holds more than one layer's temporary copies. The model then keeps 4-bit and
8-bit tensors quantized where torch has a kernel for them (localrun/model/quant.py) and
dequantizes the rest.

`load_weights` is the plain reference: every tensor dequantized with gguf-py's numpy kernels
into the compute dtype.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize

from localrun.errors import UserError
from localrun.gguf_file import LAYER_TENSORS, GGUFModelFile, open_gguf  # noqa: F401  (re-export)
from localrun.model.quant import FileTensor


def tensor_data(file: GGUFModelFile, name: str) -> np.ndarray:
    """A read-only memory map of a tensor's bytes, shaped as gguf-py's dequantize expects:
    the element shape for plain types, (rows, bytes per row) for quantized ones."""
    info = file.tensors[name]
    raw = np.memmap(file.path, dtype=np.uint8, mode="r", offset=file.header.data_offset + info.offset,
                    shape=(info.n_bytes,))
    shape = tuple(reversed(info.shape))
    plain = {QT.F32: np.float32, QT.F16: np.float16, QT.BF16: np.uint16}
    qtype = QT(info.type_id)
    if qtype in plain:
        return raw.view(plain[qtype]).reshape(shape)
    rows = int(np.prod(shape[:-1]))
    return raw.reshape(rows, info.n_bytes // rows)


def file_tensor(file: GGUFModelFile, name: str) -> FileTensor:
    info = file.tensors.get(name)
    if info is None:
        raise UserError(f"{file.path}: tensor '{name}' is missing")
    shape = tuple(reversed(info.shape))
    return FileTensor(tensor_data(file, name), QT(info.type_id), (int(np.prod(shape[:-1])), shape[-1]))


def read_tensor(file: GGUFModelFile, name: str, dtype: torch.dtype) -> torch.Tensor:
    """One tensor, dequantized, in numpy order (rows = output features), as `dtype`."""
    info = file.tensors.get(name)
    if info is None:
        raise UserError(f"{file.path}: tensor '{name}' is missing")
    qtype = QT(info.type_id)
    shape = tuple(reversed(info.shape))
    raw = tensor_data(file, name)
    if qtype == QT.F32:
        array = np.array(raw, dtype=np.float32)
    elif qtype == QT.F16:
        array = np.array(raw, dtype=np.float32)
    elif qtype == QT.BF16:   # stored as raw bytes; reinterpret through torch
        return torch.from_numpy(np.array(raw).view(np.int16)).view(torch.bfloat16).reshape(shape).to(dtype)
    else:
        array = dequantize(raw, qtype)
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).reshape(shape).to(dtype)


def weight_names(file: GGUFModelFile) -> list[str]:
    """Every tensor the file's family reads from it (layerplan/architectures.py)."""
    c = file.config
    names = ["token_embd.weight", "output_norm.weight"]
    if not c.tied_output:
        names.append("output.weight")
    if "rope_freqs.weight" in file.tensors:
        names.append("rope_freqs.weight")
    suffixes = [f"{t}.weight" for t in c.arch.layer_tensors()] + [f"{t}.bias" for t in c.arch.bias_tensors()]
    return names + [f"blk.{i}.{s}" for i in range(c.n_layers) for s in suffixes]


def file_weights(file: GGUFModelFile) -> dict[str, FileTensor]:
    """The model's tensors as the file holds them (memory maps; nothing is read yet)."""
    return {name: file_tensor(file, name) for name in weight_names(file)}


def load_weights(file: GGUFModelFile, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All tensors the family uses, keyed by GGUF name, on the CPU in `dtype`,
    dequantized (the reference path). Norm weights stay float32."""
    return {name: read_tensor(file, name, torch.float32 if _is_vector(name) else dtype)
            for name in weight_names(file)}


def _is_vector(name: str) -> bool:
    return name.endswith("norm.weight") or name.endswith(".bias") or name == "rope_freqs.weight"
