"""Leaf helpers every layer of the package uses (this module imports nothing from it): ceiling
division and the attrs validators of the configuration classes.

Every validator raises `ValueError("<Class>.<field> must be <what>, got <value>")`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def cdiv(a: int, b: int) -> int:
    """`ceil(a / b)` for ints, exactly."""
    return -(-a // b)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _validator(what: str, ok: Callable[[Any], bool], *, optional: bool = False) -> Validator:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if optional and value is None:
            return
        if not ok(value):
            raise ValueError(
                f"{type(instance).__name__}.{attribute.name} must be {what}"
                f"{' or None' if optional else ''}, got {value!r}"
            )

    return check


positive_int = _validator("a positive int", lambda v: _is_int(v) and v > 0)
non_negative_int = _validator("an int >= 0", lambda v: _is_int(v) and v >= 0)
positive = _validator("a positive number", lambda v: _is_number(v) and v > 0)
non_negative = _validator("a number >= 0", lambda v: _is_number(v) and v >= 0)
optional_positive_int = _validator("a positive int", lambda v: _is_int(v) and v > 0, optional=True)
optional_positive = _validator(
    "a positive number", lambda v: _is_number(v) and v > 0, optional=True
)


def power_of_two(least: int = 1, what: str = "") -> Validator:
    """An int power of two >= `least`; `what` says what the field counts."""
    note = f" ({what})" if what else ""
    return _validator(
        f"a power of two >= {least}{note}",
        lambda v: _is_int(v) and v >= least and not v & (v - 1),
    )


def int_in(low: int, most: int | None = None) -> Validator:
    """An int >= `low` (and <= `most` when given)."""
    span = f">= {low}" if most is None else f"in [{low}, {most}]"
    return _validator(
        f"an int {span}", lambda v: _is_int(v) and v >= low and (most is None or v <= most)
    )
