"""GGML tensor types: how many bytes a row of values takes, exactly as llama.cpp stores it.

A type packs `block_size` values into `type_size` bytes (q8_0: 32 values -> 34 bytes: 32 int8
plus one f16 scale). Kept here as a plain table so that profiling a GGUF needs no other
package; tests check it against gguf-py's GGML_QUANT_SIZES.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GGMLType:
    id: int           # the number stored in the GGUF tensor info
    name: str         # llama.cpp's spelling, lower case ("q4_k")
    block_size: int   # values per block
    type_size: int    # bytes per block

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.type_size / self.block_size

    def row_bytes(self, n_values: int) -> int:
        assert n_values % self.block_size == 0, f"{n_values} values do not fill {self.name} blocks"
        return n_values // self.block_size * self.type_size


_TABLE = [
    (0, "f32", 1, 4), (1, "f16", 1, 2), (2, "q4_0", 32, 18), (3, "q4_1", 32, 20),
    (6, "q5_0", 32, 22), (7, "q5_1", 32, 24), (8, "q8_0", 32, 34), (9, "q8_1", 32, 40),
    (10, "q2_k", 256, 84), (11, "q3_k", 256, 110), (12, "q4_k", 256, 144), (13, "q5_k", 256, 176),
    (14, "q6_k", 256, 210), (15, "q8_k", 256, 292), (16, "iq2_xxs", 256, 66), (17, "iq2_xs", 256, 74),
    (18, "iq3_xxs", 256, 98), (19, "iq1_s", 256, 50), (20, "iq4_nl", 32, 18), (21, "iq3_s", 256, 110),
    (22, "iq2_s", 256, 82), (23, "iq4_xs", 256, 136), (24, "i8", 1, 1), (25, "i16", 1, 2),
    (26, "i32", 1, 4), (27, "i64", 1, 8), (28, "f64", 1, 8), (29, "iq1_m", 256, 56),
    (30, "bf16", 1, 2), (34, "tq1_0", 256, 54), (35, "tq2_0", 256, 66), (39, "mxfp4", 32, 17),
]
GGML_TYPES: dict[int, GGMLType] = {row[0]: GGMLType(*row) for row in _TABLE}
GGML_TYPES_BY_NAME: dict[str, GGMLType] = {t.name: t for t in GGML_TYPES.values()}


def tensor_bytes(type_id: int, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of `shape` (GGUF order: shape[0] is the contiguous row) stored as `type_id`."""
    if type_id not in GGML_TYPES:
        raise ValueError(f"unknown GGML tensor type {type_id}")
    n_rows = 1
    for dim in shape[1:]:
        n_rows *= dim
    return GGML_TYPES[type_id].row_bytes(shape[0]) * n_rows
