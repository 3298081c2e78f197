"""Memory sizes as users write them (`parse_memory`: `256MiB`, `1.5GiB`, `2TB`, `512m` or a
number of bytes) and as messages print them (`format_memory`), and how much memory this machine
has (`host_memory_bytes`)."""

from __future__ import annotations

import os
import re

# Binary units (KiB, k) are powers of 1024, decimal ones (KB) powers of 1000; case is ignored.
_UNITS = {"": 1, "b": 1,
          "k": 2**10, "kib": 2**10, "kb": 10**3,
          "m": 2**20, "mib": 2**20, "mb": 10**6,
          "g": 2**30, "gib": 2**30, "gb": 10**9,
          "t": 2**40, "tib": 2**40, "tb": 10**12}  # fmt: skip
_SIZE = re.compile(r"\s*(-?)\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")
_EXAMPLES = "e.g. 256MiB, 2GiB, 1TiB or a number of bytes"


def parse_memory(value: int | str) -> int:
    """Bytes from an int or a string such as `256MiB`, `1.5GiB`, `2TB`, `512m`.

    Raises `ValueError` naming the value and what is accepted for anything else: an unknown
    unit, a negative or zero size (a memory budget of nothing makes no sense)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"memory size {value!r} is not a size; use {_EXAMPLES}")
    if isinstance(value, int):
        return _positive(value, repr(value))
    match = _SIZE.fullmatch(value)
    if not match:
        raise ValueError(f"cannot parse memory size {value!r}; use {_EXAMPLES}")
    sign, number, unit = match.groups()
    if unit.lower() not in _UNITS:
        raise ValueError(
            f"memory size {value!r} has an unknown unit {unit!r}; use B, KiB, MiB, GiB, TiB "
            "(powers of 1024; also k, m, g, t) or KB, MB, GB, TB (powers of 1000)"
        )
    exact = float(number) * _UNITS[unit.lower()]
    if 0 < exact < 1:
        raise ValueError(f"memory size {value!r} is under one byte; give {_EXAMPLES}")
    return _positive(-int(exact) if sign else int(exact), repr(value))


def _positive(size: int, shown: str) -> int:
    if size <= 0:
        raise ValueError(
            f"memory size {shown} is {'zero' if size == 0 else 'negative'}; give a positive "
            f"size, {_EXAMPLES}"
        )
    return size


def format_memory(size: int | float) -> str:
    """`size` bytes in the largest binary unit that keeps it >= 1: `1.5 GiB`, `512.0 MiB`."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{int(size)} B"


def host_memory_bytes() -> int | None:
    """Physical memory of this machine (psutil when installed, else `sysconf`), or None where
    neither can tell."""
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None
