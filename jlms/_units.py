"""Bytes as people write them, and back: a leaf module every other imports."""

from __future__ import annotations

#: Size suffixes, lower case, to bytes (decimal and binary).
UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1 << 10, "m": 1e6,
          "mb": 1e6, "mib": 1 << 20, "g": 1e9, "gb": 1e9, "gib": 1 << 30,
          "t": 1e12, "tb": 1e12, "tib": 1 << 40}


def format_bytes(n: float) -> str:
  """`n` bytes in the largest binary unit that keeps it at least 1."""
  for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if abs(n) >= size:
      return f"{n / size:.2f} {unit}"
  return f"{int(n)} B"
