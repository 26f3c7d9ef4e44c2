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

import os
import weakref

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize

from localrun.errors import UserError
from localrun.gguf_file import LAYER_TENSORS, GGUFModelFile, open_gguf  # noqa: F401  (re-export)
from localrun.model.quant import FileTensor


_FILE_MAPS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def file_map(path) -> np.memmap:
    """The whole file, memory-mapped read-only once per file (while any tensor of it lives).
    One mapping of the whole file, rather than one per tensor: the kernel places a large file
    mapping at a 2 MB-aligned address, so wherever the page cache holds the file in 2 MB folios
    (a recent kernel reads it so) each 2 MB of weights is mapped by one page-table entry, and the
    decode step's stream of weights misses the TLB once per 2 MB instead of once per 4 KB. A
    tensor's own mapping starts at its offset, rarely aligned so: the 1.1B Q4_K_M file's
    tensors were PMD-mapped for 315-383 of its 636 MiB that way, 500-600 through one mapping
    (Zen 4, kernel 6.18, 2026-12-05). Its decode step, separate processes alternating: 0.92-0.95
    of the time in a first 4 rounds, 0.95-1.14 (median ~1.0) in 10 more: within this host's
    noise. Weights copied into anonymous 2 MB pages streamed at 0.93 of the file mapping's time
    (every matmul of the file in turn, one process), so the TLB is worth a few percent at most."""
    stat = os.stat(path)
    key = (str(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    mapped = _FILE_MAPS.get(key)
    if mapped is None:
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
        _FILE_MAPS[key] = mapped
    return mapped


def tensor_data(file: GGUFModelFile, name: str) -> np.ndarray:
    """A read-only memory map of a tensor's bytes, shaped as gguf-py's dequantize expects:
    the element shape for plain types, (rows, bytes per row) for quantized ones: a view of
    file_map's mapping of the whole file."""
    info = file.tensors[name]
    start = file.header.data_offset + info.offset
    whole = file_map(file.path)
    if start + info.n_bytes > whole.shape[0]:
        raise UserError(f"{file.path}: tensor '{name}' runs past the end of the file")
    raw = whole[start:start + info.n_bytes]
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
