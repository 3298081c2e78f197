"""The bytes of a step message: a header, then the three streams of `distributed/tp_wire.py`.
Format version 2 (1 had no `launch` byte), little-endian:

    header   magic b"UATP" | version u16 | kind u16 (0: stop, 1: step) | total bytes u64 |
             uints u32 | strings u32 | text bytes u32 | scalar bytes u32 | uint width u8 |
             text mode u8 | reserved u16 (0)                                  (36 bytes)
    uints    every integer of the message, `width` bytes each: 1, 2 or 4, the narrowest
             that holds them all
    lengths  text mode 1 only: each string's length in characters, uint32
    text     the UTF-8 of every string, joined by NUL (text mode 0) or, when a string holds a
             NUL (text mode 1), one after another
    scalars  the int64, float64 and presence bytes

`unframe` checks the header against the buffer (magic, version, declared length, the streams'
sizes adding up to it) before it reads a stream: what it allocates is bounded by the buffer's
size, whatever the counts inside claim.
"""

from __future__ import annotations

import struct
import sys
from array import array
from typing import Any, NamedTuple

from unified_attn.distributed.tp_wire import Reader, Writer, check_length, split

MAGIC = b"UATP"
FORMAT_VERSION = 2  # 2: the step's `launch` byte (overlapped steps)
STOP, STEP = 0, 1
_HEADER = struct.Struct("<4sHHQIIIIBBH")
_JOINED, _LENGTHS = 0, 1  # text modes
_BIG_ENDIAN = sys.byteorder == "big"
_TYPECODES = {1: "B", 2: "H", 4: next(code for code in "IL" if array(code).itemsize == 4)}
U32_MAX = 2**32 - 1


class Header(NamedTuple):
    magic: bytes
    version: int
    kind: int
    total_bytes: int
    num_uints: int
    num_strings: int
    text_bytes: int
    scalar_bytes: int
    width: int
    text_mode: int
    reserved: int


def frame(kind: int, out: Writer) -> bytes:
    """The header and `out`'s streams, packed."""
    width, uints = _narrowest(_pack_uints(out))
    text_mode, lengths, text = _pack_text(out)
    scalars = b"".join(out.scalars)
    body = (uints, lengths, text, scalars)
    sizes = len(out.uint_stream), len(out.string_stream), len(text), len(scalars)
    total = _HEADER.size + sum(map(len, body))
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, kind, total, *sizes, width, text_mode, 0)
    return b"".join((header, *body))


def _little_endian(values: array[Any]) -> bytes:
    if _BIG_ENDIAN and values.itemsize > 1:
        values.byteswap()
    return values.tobytes()


def _pack_uints(out: Writer) -> bytes:
    try:
        return _little_endian(array(_TYPECODES[4], out.uint_stream))
    except (OverflowError, TypeError):
        index, value = next((i, v) for i, v in enumerate(out.uint_stream) if not _is_uint32(v))
        raise ValueError(
            f"step message: {out.uint_field(index)}: expected ints in [0, {U32_MAX}], got {value!r}"
        ) from None


def _is_uint32(value: Any) -> bool:
    return isinstance(value, int) and 0 <= value <= U32_MAX


def _narrowest(data: bytes) -> tuple[int, bytes]:
    """Little-endian uint32s at the narrowest width that holds them all (1, 2 or 4 bytes):
    strided slices in C, where taking `max` of the values costs as much as packing them."""
    n = len(data) // 4
    if data[2::4].count(0) == n and data[3::4].count(0) == n:
        if data[1::4].count(0) == n:
            return 1, data[0::4]
        return 2, memoryview(data).cast("H")[::2].tobytes()  # each value's two low bytes
    return 4, data


def _pack_text(out: Writer) -> tuple[int, bytes, bytes]:
    strings = out.string_stream
    try:
        joined = "\0".join(strings)
        text = joined.encode()
    except (TypeError, UnicodeEncodeError):
        index, value = next((i, s) for i, s in enumerate(strings) if not _is_utf8(s))
        raise ValueError(
            f"step message: {out.string_field(index)}: expected UTF-8 strings, got {value!r}"
        ) from None
    if joined.count("\0") == max(len(strings) - 1, 0):
        return _JOINED, b"", text
    lengths = _little_endian(array(_TYPECODES[4], map(len, strings)))
    return _LENGTHS, lengths, "".join(strings).encode()


def _is_utf8(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def unframe(data: bytes | bytearray | memoryview) -> tuple[int, Reader]:
    """The message's kind and a `Reader` over its streams; `ValueError` for a malformed one."""
    view = memoryview(data).cast("B")
    header = _read_header(view)
    at = _HEADER.size
    uints = _unpack_uints(view[at : at + header.num_uints * header.width], header.width)
    at += header.num_uints * header.width
    lengths = None
    if header.text_mode == _LENGTHS:
        lengths = _unpack_uints(view[at : at + 4 * header.num_strings], 4)
        at += 4 * header.num_strings
    text = _utf8(view[at : at + header.text_bytes])
    strings = _cut_strings(text, header.num_strings, lengths)
    return header.kind, Reader(uints, strings, view[at + header.text_bytes :])


def _read_header(view: memoryview) -> Header:
    if len(view) < 8:
        raise ValueError(f"step message truncated: {len(view)} bytes, expected a header")
    magic, version = bytes(view[:4]), int.from_bytes(view[4:6], "little")
    if magic != MAGIC:
        raise ValueError(
            f"step message: bad magic {magic!r}, expected {MAGIC!r} (not a step message from "
            "rank 0 of a unified_attn tensor-parallel group)"
        )
    if version != FORMAT_VERSION:
        raise ValueError(
            f"step message: unknown format version {version}, expected {FORMAT_VERSION} "
            "(every rank must run the same unified_attn)"
        )
    if len(view) < _HEADER.size:
        raise ValueError(
            f"step message truncated: {len(view)} bytes, the header alone needs {_HEADER.size}"
        )
    header = Header(*_HEADER.unpack_from(view))
    _check_fields(header)
    _check_sizes(header, len(view))
    return header


def _check_fields(header: Header) -> None:
    expected = (
        ("kind", header.kind, (STOP, STEP)),
        ("uint width", header.width, (1, 2, 4)),
        ("text mode", header.text_mode, (_JOINED, _LENGTHS)),
        ("reserved", header.reserved, (0,)),
    )
    for name, value, allowed in expected:
        if value not in allowed:
            raise ValueError(f"step message: header {name} {value}, expected one of {allowed}")


def _check_sizes(header: Header, size: int) -> None:
    if header.total_bytes > size:
        raise ValueError(
            f"step message truncated: the header declares {header.total_bytes} bytes, the "
            f"buffer holds {size}"
        )
    if header.total_bytes < size:
        raise ValueError(
            f"step message: {size - header.total_bytes} trailing bytes after the "
            f"{header.total_bytes} the header declares, expected none"
        )
    lengths = 4 * header.num_strings if header.text_mode == _LENGTHS else 0
    streams = header.num_uints * header.width + lengths + header.text_bytes + header.scalar_bytes
    if _HEADER.size + streams != size:
        raise ValueError(
            f"step message: length mismatch: the header's stream sizes add up to "
            f"{_HEADER.size + streams} bytes, the message has {size}"
        )


def _unpack_uints(data: memoryview, width: int) -> list[int]:
    values = array(_TYPECODES[width])
    values.frombytes(data)
    if _BIG_ENDIAN and width > 1:
        values.byteswap()
    return values.tolist()


def _utf8(data: memoryview) -> str:
    try:
        return str(data, "utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"step message: invalid UTF-8 at byte {error.start} of the strings (request ids, "
            "stop strings, bad words), expected UTF-8 text"
        ) from None


def _cut_strings(text: str, count: int, lengths: list[int] | None) -> list[str]:
    """The string stream: `text` cut at NULs, or by `lengths` when they are given."""
    if lengths is None:
        found = text.split("\0") if count or text else []
        check_length(found, count, "the strings (joined by NUL)")
        return found
    check_length(text, sum(lengths), "the strings' characters")
    return split(text, lengths)
