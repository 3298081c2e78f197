"""The three streams a step message is written in (`distributed/tp_codec.py` writes the fields,
`distributed/tp_frame.py` turns the streams into bytes and back).

A `Writer` appends every integer of the message (counts, positions, token and block ids) to a
uint stream, every string (request ids, stop strings) to a string stream, and the scalars of
sampling parameters (int64, float64, presence bytes) to a byte stream. Packing a stream is then
one pass in C (`array`, `str.join`), so a message costs a few passes over its columns, not
Python work per value.

A `Reader` walks the streams with a cursor each and refuses, with a `ValueError` naming the
field and what was expected, a count past the end of its stream, a column or flag it does not
know, or values left over at the end.
"""

from __future__ import annotations

import struct
from bisect import bisect_right
from collections.abc import Iterable, Sequence, Sized
from itertools import accumulate
from typing import Any

_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_CONSTANT, _COLUMN = 0, 1  # a column as one value repeated down its rows, or a value per row


def is_constant(values: Sequence[Any]) -> bool:
    return bool(values) and values[0] == values[-1] and values.count(values[0]) == len(values)


class Writer:
    """Typed values appended to the three streams, in order."""

    def __init__(self) -> None:
        self.uint_stream: list[int] = []
        self.string_stream: list[str] = []
        self.scalars: list[bytes] = []
        # where each field starts in its stream, to name a value that packing refuses
        self._uint_fields: list[tuple[int, str]] = []
        self._string_fields: list[tuple[int, str]] = []

    def uints(self, values: Iterable[int], what: str) -> None:
        """A count, then integers in [0, 2**32)."""
        stream, at = self.uint_stream, len(self.uint_stream)
        self._uint_fields.append((at, what))
        stream.append(0)
        stream.extend(values)
        stream[at] = len(stream) - at - 1

    def column(self, values: Sequence[int], what: str) -> None:
        """As many integers as the reader knows rows; one value when they are all the same
        (in a decode step most columns are: one new token, not new, will sample, no draft)."""
        self._uint_fields.append((len(self.uint_stream), what))
        if is_constant(values):
            self.uint_stream += (_CONSTANT, values[0])
        else:
            self.uint_stream.append(_COLUMN)
            self.uint_stream.extend(values)

    def flags(self, values: Sequence[bool], what: str) -> None:
        """A column of bools (0 and 1 pass, as the False and True they equal)."""
        if values.count(True) + values.count(False) != len(values):
            bad = next(value for value in values if value is not True and value is not False)
            raise ValueError(f"step message: {what}: expected True or False, got {bad!r}")
        self.column(values, what)

    def strings(self, values: Iterable[str], what: str) -> None:
        """A count (in the uint stream), then the strings."""
        self._uint_fields.append((len(self.uint_stream), what))
        self._string_fields.append((len(self.string_stream), what))
        before = len(self.string_stream)
        self.string_stream.extend(values)
        self.uint_stream.append(len(self.string_stream) - before)

    def flag(self, value: bool, what: str) -> None:
        if value is not True and value is not False:
            raise ValueError(f"step message: {what}: expected True or False, got {value!r}")
        self.scalars.append(b"\x01" if value else b"\x00")

    def i64(self, value: int, what: str) -> None:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"step message: {what}: expected an int, got {value!r}")
        try:
            self.scalars.append(_I64.pack(value))
        except struct.error:
            raise ValueError(f"step message: {what}: {value} does not fit in int64") from None

    def f64(self, value: float, what: str) -> None:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"step message: {what}: expected a number, got {value!r}")
        self.scalars.append(_F64.pack(value))

    def uint_field(self, index: int) -> str:
        """The name of the field that holds `uint_stream[index]`."""
        return _field(self._uint_fields, index)

    def string_field(self, index: int) -> str:
        return _field(self._string_fields, index)


def _field(fields: list[tuple[int, str]], index: int) -> str:
    starts = [start for start, _ in fields]
    return fields[max(bisect_right(starts, index) - 1, 0)][1]


class Reader:
    """Typed values read back from the three streams; every read checks it stays inside."""

    def __init__(self, uints: list[int], strings: list[str], scalars: memoryview) -> None:
        self.uint_stream, self.string_stream, self.scalars = uints, strings, scalars
        self.uint_at = self.string_at = self.scalar_at = 0

    def count(self, what: str) -> int:
        at = self.uint_at
        if at >= len(self.uint_stream):
            raise ValueError(f"step message truncated: {what}: expected a count, no uints left")
        self.uint_at = at + 1
        return self.uint_stream[at]

    def _take_uints(self, n: int, what: str) -> list[int]:
        start, end = self.uint_at, self.uint_at + n
        if end > len(self.uint_stream):
            left = len(self.uint_stream) - start
            raise ValueError(f"step message: {what}: count {n} exceeds the {left} uints left")
        self.uint_at = end
        return self.uint_stream[start:end]

    def uints(self, what: str) -> list[int]:
        """A count, then as many uints."""
        return self._take_uints(self.count(what), what)

    def column(self, rows: int, what: str) -> list[int]:
        kind = self.count(what)
        if kind == _CONSTANT:
            return [self.count(what)] * rows
        if kind != _COLUMN:
            raise ValueError(
                f"step message: {what}: column kind {kind}, expected {_CONSTANT} (one value) "
                f"or {_COLUMN} (a value per row)"
            )
        return self._take_uints(rows, what)

    def flags(self, rows: int, what: str) -> list[bool]:
        """A column of 0s and 1s, as bools."""
        column = self.column(rows, what)
        if column.count(0) + column.count(1) != rows:
            bad = next(value for value in column if value > 1)
            raise ValueError(f"step message: {what}: flag {bad}, expected 0 or 1")
        return [column[0] == 1] * rows if is_constant(column) else list(map(bool, column))

    def strings(self, what: str) -> list[str]:
        n = self.count(what)
        start, end = self.string_at, self.string_at + n
        if end > len(self.string_stream):
            left = len(self.string_stream) - start
            raise ValueError(f"step message: {what}: count {n} exceeds the {left} strings left")
        self.string_at = end
        return self.string_stream[start:end]

    def _take_scalar(self, nbytes: int, what: str) -> memoryview:
        start, end = self.scalar_at, self.scalar_at + nbytes
        if end > len(self.scalars):
            raise ValueError(
                f"step message truncated: {what} needs {nbytes} scalar bytes at offset {start}, "
                f"{len(self.scalars) - start} left"
            )
        self.scalar_at = end
        return self.scalars[start:end]

    def flag(self, what: str) -> bool:
        (byte,) = self._take_scalar(1, what)
        if byte > 1:
            raise ValueError(f"step message: {what}: flag byte {byte}, expected 0 or 1")
        return byte == 1

    def i64(self, what: str) -> int:
        return int(_I64.unpack(self._take_scalar(8, what))[0])

    def f64(self, what: str) -> float:
        return float(_F64.unpack(self._take_scalar(8, what))[0])

    def finish(self) -> None:
        """Refuse values no field read."""
        left = {
            "uints": len(self.uint_stream) - self.uint_at,
            "strings": len(self.string_stream) - self.string_at,
            "scalar bytes": len(self.scalars) - self.scalar_at,
        }
        extra = ", ".join(f"{n} {name}" for name, n in left.items() if n)
        if extra:
            raise ValueError(
                f"step message: trailing values after the last field ({extra}), expected none"
            )


def check_length(values: Sized, expected: int, what: str) -> None:
    if len(values) != expected:
        raise ValueError(
            f"step message: {what}: length mismatch: {len(values)} found, expected {expected}"
        )


def split(flat: Sequence[Any], lengths: list[int]) -> list[Any]:
    """`flat` cut into consecutive pieces of `lengths` (which add up to `len(flat)`)."""
    return [flat[end - n : end] for n, end in zip(lengths, accumulate(lengths), strict=True)]


def split_lists(flat: list[int], lengths: list[int]) -> list[list[int]]:
    """`split` into fresh lists; cheaper when every length is 0 or every one is 1 (one token
    per request, no new block: a decode step)."""
    if is_constant(lengths) and lengths[0] <= 1:
        return [[value] for value in flat] if lengths[0] else [[] for _ in lengths]
    return [
        flat[end - n : end] if n else []
        for n, end in zip(lengths, accumulate(lengths), strict=True)
    ]
