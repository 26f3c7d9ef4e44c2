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

from layerplan.ggml_types import GGML_TYPES, tensor_bytes

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
KEEP_ARRAY_MAX = 1024  # arrays longer than this keep only their length
MAX_DIMS = 4           # ggml's GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 4    # arrays of arrays: deeper nesting is refused, not recursed into
MAX_ALIGNMENT = 1 << 20

# GGUF value types: id -> struct format (None for string/array)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# the fewest bytes one item of a type can take (a string's length, an array's type and count)
_MIN_BYTES = {**{t: struct.calcsize("<" + f) for t, f in _SCALAR.items()}, _STRING: 8, _ARRAY: 12}
_MIN_KV_BYTES = 8 + 4 + 1            # key length, value type, the smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8   # name length, n_dims, one dimension, type, offset


def shown(text: str, limit: int = 80) -> str:
    """A name read from a file, safe to put in a one-line message: control characters escaped,
    long names cut."""
    text = text if len(text) <= limit else text[:limit] + "..."
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands; str() is one sentence naming the
    file, `detail` the clause that says what is wrong."""

    def __init__(self, detail: str, name: str | None = None):
        detail = shown(detail, limit=1000)     # names in it come from the file
        self.detail = detail
        super().__init__(f"{name} is not a valid GGUF file: {detail}" if name else detail)


@dataclass(frozen=True)
class LongArray:
    """A metadata array too long to keep (tokenizer tokens, merges): only its length and the
    GGUF type id of its items."""
    length: int
    item_type: int = _STRING

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
    value_types: dict | None = None   # key -> GGUF value type id (for arrays: (9, item type id))
    value_offsets: dict | None = None  # key -> where its value starts in the file (see read_array)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "llama"))

    def arch_value(self, key: str, default=None):
        """metadata['<arch>.<key>'], e.g. arch_value('block_count')."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


class _Cursor:
    """Reads little-endian fields from `buf`, checking every length against the bytes left
    before it unpacks, slices or allocates anything."""

    def __init__(self, buf, end: int, *, keep_all: bool = False, raw_strings: bool = False):
        self.buf, self.pos, self.end = buf, 0, end
        self.keep_all, self.raw_strings = keep_all, raw_strings   # long arrays in full; strings as bytes

    @property
    def left(self) -> int:
        return self.end - self.pos

    def take(self, n: int, what: str) -> int:
        """Step over n bytes that must exist; returns where they start."""
        if n > self.left:
            raise GGUFFormatError(f"the header ends early: {what} runs past the end of the file")
        start, self.pos = self.pos, self.pos + n
        return start

    def unpack(self, fmt: str, what: str):
        fmt = "<" + fmt
        start = self.take(struct.calcsize(fmt), what)
        values = struct.unpack_from(fmt, self.buf, start)
        return values[0] if len(values) == 1 else values

    def string(self, what: str) -> str:
        n = self.unpack("Q", what)
        start = self.take(n, what)
        if self.raw_strings:
            return bytes(self.buf[start:start + n])
        try:
            return bytes(self.buf[start:start + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFFormatError(f"{what} is not valid UTF-8 text") from None

    def skip_string(self, what: str) -> None:
        self.take(self.unpack("Q", what), what)

    def value(self, type_id: int, what: str, depth: int = 0):
        if type_id in _SCALAR:
            return self.unpack(_SCALAR[type_id], what)
        if type_id == _STRING:
            return self.string(what)
        if type_id == _ARRAY:
            return self.array(what, depth)
        raise GGUFFormatError(f"{what} has unknown value type {type_id}")

    def array(self, what: str, depth: int):
        item_type, n = self.unpack("I", what), self.unpack("Q", what)
        if item_type not in _MIN_BYTES:
            raise GGUFFormatError(f"{what} is an array of unknown value type {item_type}")
        if n > self.left // _MIN_BYTES[item_type]:
            raise GGUFFormatError(f"{what} claims {n:,} items, more than the {self.left:,} bytes left "
                                  f"in the file can hold")
        if item_type == _ARRAY and depth + 1 >= MAX_ARRAY_DEPTH:
            raise GGUFFormatError(f"{what} nests arrays more than {MAX_ARRAY_DEPTH} deep")
        if item_type in _SCALAR:
            size = _MIN_BYTES[item_type]
            start = self.take(n * size, what)
            if n > KEEP_ARRAY_MAX and not self.keep_all:
                return LongArray(n, item_type)
            return list(struct.unpack_from(f"<{n}{_SCALAR[item_type]}", self.buf, start))
        if n > KEEP_ARRAY_MAX and not self.keep_all:
            for _ in range(n):
                if item_type == _STRING:
                    self.skip_string(what)
                else:
                    self.value(item_type, what, depth + 1)
            return LongArray(n, item_type)
        return [self.value(item_type, what, depth + 1) for _ in range(n)]


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse the header of the GGUF file at `path`. Anything malformed (a length past the end of
    the file, bad UTF-8, a duplicate name, a tensor outside the file) raises GGUFFormatError
    with one sentence; nothing is allocated or unpacked before its size is checked."""
    path = Path(path)
    with open(path, "rb") as f:
        file_bytes = os.fstat(f.fileno()).st_size
        if file_bytes < 24:
            raise GGUFFormatError(f"it is too short ({file_bytes} bytes) to be a GGUF file", path.name)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return _parse(path, buf, file_bytes)
            except GGUFFormatError as err:
                raise GGUFFormatError(err.detail, path.name) from None


def _parse(path: Path, buf, file_bytes: int) -> GGUFHeader:
    cur = _Cursor(buf, file_bytes)
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise GGUFFormatError("it does not start with 'GGUF', so it is not a GGUF file")
    cur.pos = 4
    version = cur.unpack("I", "the version")
    if version not in (2, 3):
        raise GGUFFormatError(f"it is GGUF version {version}; only versions 2 and 3 are read")
    n_tensors, n_kv = cur.unpack("Q", "the tensor count"), cur.unpack("Q", "the metadata count")
    if n_kv > cur.left // _MIN_KV_BYTES:
        raise GGUFFormatError(f"the header ends early: it claims {n_kv:,} metadata entries, more than the file's "
                              f"{file_bytes:,} bytes can hold")
    if n_tensors > cur.left // _MIN_TENSOR_INFO_BYTES:
        raise GGUFFormatError(f"the header ends early: it claims {n_tensors:,} tensors, more than the file's "
                              f"{file_bytes:,} bytes can hold")
    metadata, value_types, value_offsets = {}, {}, {}
    for i in range(n_kv):
        key = cur.string(f"metadata key {i + 1}")
        if key in metadata:
            raise GGUFFormatError(f"metadata key '{shown(key)}' appears twice")
        type_id = cur.unpack("I", f"the type of '{shown(key)}'")
        start = cur.pos
        metadata[key] = cur.value(type_id, f"the value of '{shown(key)}'")
        value_types[key] = (type_id, struct.unpack_from("<I", buf, start)[0]) if type_id == _ARRAY else type_id
        value_offsets[key] = start
    infos = [_tensor_info(cur, i) for i in range(n_tensors)]
    names = set()
    for info in infos:
        if info.name in names:
            raise GGUFFormatError(f"tensor '{shown(info.name)}' appears twice")
        names.add(info.name)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if (type(alignment) is not int or not 1 <= alignment <= MAX_ALIGNMENT
            or alignment & (alignment - 1)):
        raise GGUFFormatError(f"general.alignment is {alignment!r}; it must be a power of two up to {MAX_ALIGNMENT:,}")
    data_offset = (cur.pos + alignment - 1) // alignment * alignment
    _check_tensor_data(infos, alignment, data_offset, file_bytes)
    return GGUFHeader(path, version, metadata, tuple(infos), data_offset, file_bytes, value_types, value_offsets)


def read_array(header: GGUFHeader, key: str, *, raw_strings: bool = False) -> list:
    """The whole of metadata array `key` (the header keeps only the length of long ones, such as
    the vocabulary); strings as bytes with raw_strings. Bounded like every other read."""
    assert header.value_types.get(key, (None,))[0] == _ARRAY, f"{key} is not an array"
    with open(header.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf, min(len(buf), header.file_bytes), keep_all=True, raw_strings=raw_strings)
        cur.pos = header.value_offsets[key]
        try:
            return cur.array(f"the value of '{shown(key)}'", 0)
        except GGUFFormatError as err:
            raise GGUFFormatError(err.detail, header.path.name) from None


def _tensor_info(cur: _Cursor, i: int) -> TensorInfo:
    name = cur.string(f"the name of tensor {i + 1}")
    name_shown = shown(name)
    what = f"the info of tensor '{name_shown}'"
    n_dims = cur.unpack("I", what)
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFFormatError(f"tensor '{name_shown}' has {n_dims} dimensions; GGUF tensors have 1 to {MAX_DIMS}")
    shape = tuple(cur.unpack("Q", what) for _ in range(n_dims))
    n_elements = 1
    for dim in shape:
        n_elements *= dim
    if n_elements == 0 or n_elements >= 2**63:
        raise GGUFFormatError(f"tensor '{name_shown}' has shape {list(shape)}, which holds no data or more than ggml can index")
    type_id, offset = cur.unpack("I", what), cur.unpack("Q", what)
    ggml_type = GGML_TYPES.get(type_id)
    if ggml_type is None:
        raise GGUFFormatError(f"tensor '{name_shown}' has unknown type id {type_id}")
    if shape[0] % ggml_type.block_size:
        raise GGUFFormatError(f"tensor '{name_shown}' has rows of {shape[0]:,} values, which do not fill "
                              f"{ggml_type.name} blocks of {ggml_type.block_size}")
    return TensorInfo(name, shape, type_id, offset, tensor_bytes(type_id, shape))


def _check_tensor_data(infos: list[TensorInfo], alignment: int, data_offset: int, file_bytes: int) -> None:
    """Every tensor's bytes lie inside the file, aligned, and no two tensors share bytes."""
    for info in infos:
        if info.offset % alignment:
            raise GGUFFormatError(f"tensor '{shown(info.name)}' starts at offset {info.offset:,}, which is not "
                                  f"a multiple of the alignment {alignment}")
        end = data_offset + info.offset + info.n_bytes
        if end > file_bytes:
            raise GGUFFormatError(f"it is truncated: tensor '{shown(info.name)}' ends at byte {end:,}, past the "
                                  f"end of the file at byte {file_bytes:,}")
    by_offset = sorted(infos, key=lambda t: t.offset)
    for before, after in zip(by_offset, by_offset[1:]):
        if before.offset + before.n_bytes > after.offset:
            raise GGUFFormatError(f"tensors '{shown(before.name)}' and '{shown(after.name)}' overlap in the file")
