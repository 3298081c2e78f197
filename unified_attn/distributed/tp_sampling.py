"""`SamplingParams` in the step message (`distributed/tp_codec.py`): every field written
explicitly, with its type, in the order of `SAMPLING_FIELDS`.

`write_sampling_params` refuses a `SamplingParams` whose fields differ from `SAMPLING_FIELDS`
(a field added to the class without an encoding here fails loudly, and a test compares the
two), and `read_sampling_params` rebuilds the parameters through their own validators.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs

from unified_attn.distributed.tp_wire import Reader, Writer
from unified_attn.sampling_params import RequestOutputKind, SamplingParams


class FieldKind(Protocol):
    """How one type of value is written and read back."""

    def write(self, out: Writer, value: Any, what: str) -> None: ...

    def read(self, data: Reader, what: str) -> Any: ...


class _Int:
    """An int64."""

    def write(self, out: Writer, value: Any, what: str) -> None:
        out.i64(value, what)

    def read(self, data: Reader, what: str) -> int:
        return data.i64(what)


class _Float:
    """A float64 (an int is written as its float)."""

    def write(self, out: Writer, value: Any, what: str) -> None:
        out.f64(value, what)

    def read(self, data: Reader, what: str) -> float:
        return data.f64(what)


class _Bool:
    """One byte, 0 or 1."""

    def write(self, out: Writer, value: Any, what: str) -> None:
        out.flag(value, what)

    def read(self, data: Reader, what: str) -> bool:
        return data.flag(what)


class _Strings:
    """A list of strings (stop strings, bad words)."""

    def write(self, out: Writer, value: Any, what: str) -> None:
        out.strings(value, what)

    def read(self, data: Reader, what: str) -> tuple[str, ...]:
        return tuple(data.strings(what))


class _TokenIds:
    """Token ids: a count, then the ids."""

    def write(self, out: Writer, value: Any, what: str) -> None:
        out.uints(value, what)

    def read(self, data: Reader, what: str) -> tuple[int, ...]:
        return tuple(data.uints(what))


class _Biases:
    """{token id: bias}: the token ids (count, uints), then a float64 bias for each."""

    def write(self, out: Writer, value: Any, what: str) -> None:
        if not isinstance(value, dict):
            raise ValueError(f"step message: {what}: expected a dict, got {value!r}")
        out.uints(list(value), what)
        for bias in value.values():
            out.f64(bias, what)

    def read(self, data: Reader, what: str) -> dict[int, float]:
        tokens = data.uints(what)
        biases = {token: data.f64(what) for token in tokens}
        if len(biases) != len(tokens):
            raise ValueError(f"step message: {what}: a token id appears twice, expected once")
        return biases


class _OutputKind:
    """A `RequestOutputKind`, as its value in an int64."""

    def write(self, out: Writer, value: Any, what: str) -> None:
        if not isinstance(value, RequestOutputKind):
            raise ValueError(f"step message: {what}: expected a RequestOutputKind, got {value!r}")
        out.i64(value.value, what)

    def read(self, data: Reader, what: str) -> RequestOutputKind:
        value = data.i64(what)
        try:
            return RequestOutputKind(value)
        except ValueError:
            known = ", ".join(f"{kind.value} ({kind.name})" for kind in RequestOutputKind)
            raise ValueError(f"step message: {what}: {value}, expected one of {known}") from None


@attrs.frozen
class _Optional:
    """A presence byte (0: None), then the value."""

    inner: FieldKind

    def write(self, out: Writer, value: Any, what: str) -> None:
        out.flag(value is not None, what)
        if value is not None:
            self.inner.write(out, value, what)

    def read(self, data: Reader, what: str) -> Any:
        return self.inner.read(data, what) if data.flag(what) else None


INT, FLOAT, BOOL, STRINGS, TOKEN_IDS = _Int(), _Float(), _Bool(), _Strings(), _TokenIds()

# Every field of `SamplingParams`, in the order written; a change here is a new
# `tp_frame.FORMAT_VERSION`.
SAMPLING_FIELDS: tuple[tuple[str, FieldKind], ...] = (
    ("n", INT),
    ("max_tokens", _Optional(INT)),
    ("min_tokens", INT),
    ("temperature", FLOAT),
    ("top_k", INT),
    ("top_p", FLOAT),
    ("min_p", FLOAT),
    ("presence_penalty", FLOAT),
    ("frequency_penalty", FLOAT),
    ("repetition_penalty", FLOAT),
    ("seed", _Optional(INT)),
    ("stop", STRINGS),
    ("stop_token_ids", TOKEN_IDS),
    ("ignore_eos", BOOL),
    ("logprobs", _Optional(INT)),
    ("prompt_logprobs", _Optional(INT)),
    ("logit_bias", _Optional(_Biases())),
    ("allowed_token_ids", _Optional(TOKEN_IDS)),
    ("bad_words", STRINGS),
    ("skip_special_tokens", BOOL),
    ("spaces_between_special_tokens", BOOL),
    ("include_stop_str_in_output", BOOL),
    ("output_kind", _OutputKind()),
    ("prompt_logits", BOOL),
    ("return_logits", BOOL),
)
_NAMES = frozenset(name for name, _ in SAMPLING_FIELDS)


def check_sampling_fields(params_type: type) -> None:
    """Refuse a parameters class whose fields are not exactly those `SAMPLING_FIELDS` encodes."""
    names = {field.name for field in attrs.fields(params_type)}
    if names - _NAMES:
        raise ValueError(
            f"step message: {params_type.__name__} fields {sorted(names - _NAMES)} have no "
            "encoding; add each, with its type, to SAMPLING_FIELDS in "
            "unified_attn/distributed/tp_sampling.py and bump tp_frame.FORMAT_VERSION"
        )
    if _NAMES - names:
        raise ValueError(
            f"step message: SAMPLING_FIELDS encodes {sorted(_NAMES - names)}, which "
            f"{params_type.__name__} no longer has; remove them and bump tp_frame.FORMAT_VERSION"
        )


def write_sampling_params(out: Writer, params: SamplingParams | None) -> None:
    out.flag(params is not None, "sampling params present")
    if params is None:
        return
    if not isinstance(params, SamplingParams):
        raise ValueError(
            f"step message: expected SamplingParams or None, got {type(params).__name__}"
        )
    check_sampling_fields(type(params))
    for name, kind in SAMPLING_FIELDS:
        kind.write(out, getattr(params, name), f"sampling parameter {name}")


def read_sampling_params(data: Reader, request_id: str) -> SamplingParams | None:
    if not data.flag("sampling params present"):
        return None
    values = {name: kind.read(data, f"sampling parameter {name}") for name, kind in SAMPLING_FIELDS}
    try:
        return SamplingParams(**values)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"step message: new request {request_id!r}: sampling parameters refused: {error}"
        ) from None
