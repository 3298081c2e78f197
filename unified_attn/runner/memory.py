"""Memory sizes as users write them: `256MiB`, `1.5GiB`, `512m` or a number of bytes."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6,
          "mib": 2**20, "g": 2**30, "gb": 10**9, "gib": 2**30}  # fmt: skip


def parse_memory(value: int | str) -> int:
    """Bytes from an int or a string such as `256MiB`, `1.5GiB`, `512m`."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse memory size {value!r}; use e.g. 256MiB, 2GiB or bytes")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
