"""Byte sizes written by people ("16MiB", "64 KB", 4096) turned into integers of bytes."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: object) -> int:
    """Return ``value`` as a whole number of bytes.

    Accepts an int (bytes) or a string with a unit: B, KB/MB/GB/TB (powers of 10),
    KiB/MiB/GiB/TiB (powers of 2). Raises ``ValueError`` with the reason otherwise.
    """
    if isinstance(value, bool):
        raise ValueError("expected a size in bytes, e.g. 16777216 or \"16MiB\"")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m and m.group(2).lower() in _UNITS:
            n = float(m.group(1)) * _UNITS[m.group(2).lower()]
            if n.is_integer():
                return int(n)
    raise ValueError("expected a size in bytes, e.g. 16777216 or \"16MiB\"")


def format_bytes(n: float) -> str:
    """Human-readable binary size, e.g. ``format_bytes(3 * 2**20) == '3.00 MiB'``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"
