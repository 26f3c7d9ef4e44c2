"""Read a GGUF file's header (metadata and tensor infos) without touching tensor data.

gguf-py's GGUFReader decodes every tokenizer string into numpy objects, which takes seconds;
planning needs only the hyper-parameters and each tensor's type and shape. This reader walks
the header through a memory map, keeps scalars and short arrays, and for long arrays (the
vocabulary, the merges) records only their length.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from layerplan.ggml_types import tensor_bytes

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
KEEP_ARRAY_MAX = 1024  # arrays longer than this keep only their length

# GGUF value types: id -> struct format (None for string/array)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands."""


@dataclass(frozen=True)
class LongArray:
    """A metadata array too long to keep (tokenizer tokens, merges): only its length."""
    length: int

    def __len__(self) -> int:
        return self.length


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]   # GGUF order: shape[0] is the contiguous (row) dimension
    type_id: int
    offset: int              # from the start of the data section
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    metadata: dict
    tensors: tuple[TensorInfo, ...]
    data_offset: int         # where tensor data starts in the file
    file_bytes: int

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "llama"))

    def arch_value(self, key: str, default=None):
        """metadata['<arch>.<key>'], e.g. arch_value('block_count')."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


class _Cursor:
    def __init__(self, buf, pos: int = 0):
        self.buf, self.pos = buf, pos

    def unpack(self, fmt: str):
        try:
            values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        except struct.error:
            raise GGUFFormatError("the header ends early (truncated file?)") from None
        self.pos += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        n = self.unpack("Q")
        if self.pos + n > len(self.buf):
            raise GGUFFormatError("a header string runs past the end of the file")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]

    def value(self, type_id: int):
        if type_id in _SCALAR:
            return self.unpack(_SCALAR[type_id])
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            return self.array()
        raise GGUFFormatError(f"unknown metadata value type {type_id}")

    def array(self):
        item_type, n = self.unpack("I"), self.unpack("Q")
        if n > KEEP_ARRAY_MAX:
            if item_type in _SCALAR:
                self.pos += n * struct.calcsize(_SCALAR[item_type])
            elif item_type == _STRING:
                for _ in range(n):
                    self.skip_string()
            else:
                for _ in range(n):
                    self.value(item_type)
            return LongArray(n)
        if item_type in _SCALAR and n:
            fmt = f"{n}{_SCALAR[item_type]}"
            values = struct.unpack_from("<" + fmt, self.buf, self.pos)
            self.pos += struct.calcsize("<" + fmt)
            return list(values)
        return [self.value(item_type) for _ in range(n)]


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse the header of the GGUF file at `path`; raises GGUFFormatError for anything else."""
    path = Path(path)
    with open(path, "rb") as f:
        file_bytes = os.fstat(f.fileno()).st_size
        if file_bytes < 24:
            raise GGUFFormatError(f"{path.name} is too short to be a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(path, buf, file_bytes)


def _parse(path: Path, buf, file_bytes: int) -> GGUFHeader:
    cur = _Cursor(buf)
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise GGUFFormatError(f"{path.name} is not a GGUF file (it does not start with 'GGUF')")
    cur.pos = 4
    version = cur.unpack("I")
    if version not in (2, 3):
        raise GGUFFormatError(f"{path.name} is GGUF version {version}; only versions 2 and 3 are read")
    n_tensors, n_kv = cur.unpack("Q"), cur.unpack("Q")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("I")
        shape = tuple(cur.unpack("Q") for _ in range(n_dims))
        type_id, offset = cur.unpack("I"), cur.unpack("Q")
        try:
            n_bytes = tensor_bytes(type_id, shape)
        except (ValueError, AssertionError) as err:
            raise GGUFFormatError(f"tensor {name}: {err}") from None
        infos.append(TensorInfo(name, shape, type_id, offset, n_bytes))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_offset = (cur.pos + alignment - 1) // alignment * alignment
    return GGUFHeader(path, version, metadata, tuple(infos), data_offset, file_bytes)
