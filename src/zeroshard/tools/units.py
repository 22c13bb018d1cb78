"""Sizes and counts as people write them: decimal GB as in the ZeRO paper (7.5e9 x 16 B = 120 GB),
binary GiB when asked for; parameter counts with k / M / B / T. Read from flags, printed in tables."""

from __future__ import annotations

import re

_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
_NUMBER = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def _parse(text: str, units: dict[str, int], what: str) -> int:
    match = _NUMBER.match(str(text))
    unit = match.group(2).lower() if match else None
    if unit not in units:
        allowed = ", ".join(u for u in units if u) or "none"
        raise ValueError(f"cannot read {what} {text!r}: expected a number with an optional unit ({allowed})")
    assert match is not None  # without a match unit is None, which is not in units
    return round(float(match.group(1)) * units[unit])


def parse_bytes(text: str) -> int:
    """'32GiB' -> 34359738368, '32GB' -> 32e9, '1.5e10' -> bytes."""
    return _parse(text, _BYTE_UNITS, "a memory size")


def parse_count(text: str) -> int:
    """'7.5e9', '7.5B', '125M' -> a parameter count (B = billion)."""
    return _parse(text, _COUNT_UNITS, "a parameter count")


def format_bytes(nbytes: float) -> str:
    """Decimal units, one decimal, largest unit that keeps the value >= 1: 120.0 GB, 1.9 GB, 500.0 MB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def format_count(count: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(count) >= scale:
            return f"{count / scale:.2f}{unit}"
    return f"{count:.0f}"
