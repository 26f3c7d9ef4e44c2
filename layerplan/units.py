"""Byte and size units: parse what a user types (`24GiB`, `16G`, `512MiB`), format what we print."""
from __future__ import annotations

import re

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

_UNITS = {
    "": 1, "b": 1,
    "k": KiB, "kib": KiB, "kb": 1000,
    "m": MiB, "mib": MiB, "mb": 1000**2,
    "g": GiB, "gib": GiB, "gb": 1000**3,
    "t": 1 << 40, "tib": 1 << 40, "tb": 1000**4,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """'24GiB' -> 25769803776. Bare K/M/G/T are binary (as memory is sold); KB/MB/GB are decimal."""
    match = _SIZE.match(str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"'{text}' is not a size; write it like 24GiB, 16G or 512MiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: float) -> str:
    """Binary units with three significant digits: 1536 -> '1.50 KiB'."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            value = n / size
            return f"{sign}{value:.3g} {unit}" if value < 100 else f"{sign}{value:.0f} {unit}"
    return f"{sign}{n:.0f} B"

