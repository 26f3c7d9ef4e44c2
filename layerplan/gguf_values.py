"""Typed, bounded reads of GGUF metadata: a wrong type, a missing key, NaN, zero or an absurd
size becomes one GGUFFormatError sentence naming the key, before anything is allocated from it.

The limits are far above any published model and far below what would exhaust a desktop:
`llama.block_count = 2**31 - 1` is refused here, not discovered as an 8 GB list.
"""
from __future__ import annotations

import math

from layerplan.gguf_header import GGUFFormatError, GGUFHeader, LongArray

MAX_LAYERS = 4096
# the trained context of a file without `<arch>.context_length` (llama.cpp refuses such files;
# the planner and the model builder both assume this, and no more)
DEFAULT_CONTEXT_LENGTH = 2048
MAX_WIDTH = 1 << 20         # embedding, FFN and head widths
MAX_HEADS = 1 << 14
MAX_CONTEXT = 1 << 28       # trained context (10M-token models exist)
MAX_VOCAB = 1 << 24
MAX_EXPERTS = 1 << 12

REQUIRED = object()  # a default that means "the key must be present"


def meta_int(header: GGUFHeader, key: str, default=REQUIRED, *, low: int = 0, high: int) -> int:
    """metadata[key] as an int in [low, high]; `default` when absent (required if not given)."""
    value = header.metadata.get(key, default)
    if value is REQUIRED:
        raise GGUFFormatError(f"metadata key '{key}' is missing")
    return _checked_int(key, value, low, high)


def arch_int(header: GGUFHeader, key: str, default=REQUIRED, *, low: int = 0, high: int) -> int:
    """meta_int of '<architecture>.<key>'."""
    return meta_int(header, f"{header.architecture}.{key}", default, low=low, high=high)


def arch_ints_per_layer(header: GGUFHeader, key: str, n_layers: int, default=REQUIRED, *,
                        low: int = 0, high: int) -> list[int]:
    """'<architecture>.<key>' per layer: one int for every layer, or an array of n_layers ints
    (as some families store head counts). `default` may itself be such a list."""
    full = f"{header.architecture}.{key}"
    value = header.metadata.get(full, default)
    if value is REQUIRED:
        raise GGUFFormatError(f"metadata key '{full}' is missing")
    if isinstance(value, LongArray):
        raise GGUFFormatError(f"'{full}' lists {len(value):,} values for {n_layers} layers")
    if isinstance(value, (list, tuple)):
        if len(value) != n_layers:
            raise GGUFFormatError(f"'{full}' lists {len(value)} values for {n_layers} layers")
        return [_checked_int(full, v, low, high) for v in value]
    return [_checked_int(full, value, low, high)] * n_layers


def arch_float(header: GGUFHeader, key: str, default: float, *, low: float, high: float) -> float:
    """'<architecture>.<key>' as a finite float with low < value <= high."""
    full = f"{header.architecture}.{key}"
    value = header.metadata.get(full, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GGUFFormatError(f"'{full}' is {_kind(value)}, not a number")
    if not math.isfinite(value) or not low < value <= high:
        raise GGUFFormatError(f"'{full}' is {value!r}; it must be a finite number above {low:g} "
                              f"and at most {high:g}")
    return float(value)


def _checked_int(key: str, value, low: int, high: int) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise GGUFFormatError(f"'{key}' is {_kind(value)}, not an integer")
    if not low <= value <= high:
        raise GGUFFormatError(f"'{key}' is {value:,}; it must be from {low:,} to {high:,}")
    return value


def _kind(value) -> str:
    if isinstance(value, (list, tuple, LongArray)):
        return f"an array of {len(value):,} values"
    if isinstance(value, float):
        return repr(value)
    return f"a {type(value).__name__}"
