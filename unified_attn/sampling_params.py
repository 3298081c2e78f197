"""Per-request generation parameters, named and defined as in vLLM (a leaf module: the scheduler
and engine import it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from unified_attn.utils import (
    non_negative,
    non_negative_int,
    optional_positive_int,
    positive,
    positive_int,
)

_Check = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def _fail(instance: Any, attribute: attrs.Attribute[Any], what: str, value: Any) -> None:
    raise ValueError(f"{type(instance).__name__}.{attribute.name} must be {what}, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _optional(check: _Check) -> _Check:
    """`check`, or nothing when the value is None."""

    def run(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None:
            check(instance, attribute, value)

    return run


def _boolean(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        _fail(instance, attribute, "True or False", value)


def _int_or_none(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not _is_int(value):
        _fail(instance, attribute, "an int or None", value)


def _between(low: float, high: float) -> _Check:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not (_is_number(value) and low <= value <= high):
            _fail(instance, attribute, f"a number in [{low:g}, {high:g}]", value)

    return check


def _top_k(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not (_is_int(value) and value >= -1):
        _fail(instance, attribute, "an int >= 1, or 0 or -1 for no top-k filter", value)


def _top_p(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not (_is_number(value) and 0.0 < value <= 1.0):
        _fail(instance, attribute, "a number in (0, 1] (1 keeps every token)", value)


def _as_tuple(value: Any) -> Any:
    """Lists, tuples and sets become tuples; anything else is left for the validator to name."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple, set, frozenset)) else value


def _stop_strings(value: Any) -> Any:
    """vLLM accepts one stop string or a list of them."""
    return (value,) if isinstance(value, str) else _as_tuple(value)


def _token_ids(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, tuple) or not all(_is_int(t) and t >= 0 for t in value):
        _fail(instance, attribute, "a list of token ids (ints >= 0)", value)


def _strings(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, tuple) or not all(isinstance(s, str) and s for s in value):
        _fail(instance, attribute, "a non-empty string or a list of non-empty strings", value)


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How one prompt is sampled; fields and definitions follow vLLM's `SamplingParams`.

    - `n`: completions per prompt (`RequestOutput.outputs[0..n-1]`); they share the prompt's
      prefix cache. Seeded, completion `i` uses `seed + i`.
    - `max_tokens`: tokens to generate at most; None means up to `max_model_len`.
    - `min_tokens`: before this many tokens, EOS and `stop_token_ids` cannot be sampled (their
      logits are masked) and stop strings are not looked for.
    - `temperature`: 0 is greedy (the default here; vLLM's default is 1.0).
    - `top_k`: keep the k most likely tokens; 0 or -1 keeps all. `top_p`: nucleus mass; 1 keeps
      all.
    - `presence_penalty`, `frequency_penalty` (in [-2, 2]): subtracted from the logits of tokens
      the output already holds, once (presence) or once per occurrence (frequency).
      `repetition_penalty` (> 0): the logits of tokens in the prompt or the output are divided
      by it when positive and multiplied by it when negative. All three act on the logits
      before temperature, top-k and top-p, and apply to greedy requests too.
    - `seed`: the request's own random stream (kept across preemption); None shares the
      engine's.
    - `stop`: strings that end the output once its text contains one; the text is cut before
      it (needs a tokenizer). `stop_token_ids`: tokens that end it (the token stays in
      `token_ids`, not in the text). `ignore_eos`: EOS does not end it.
    - `logprobs`: return the log-probabilities of the `logprobs` most likely tokens of every
      step, plus the sampled one (0: only the sampled one), from the model's raw logits.
    - `prompt_logits`, `return_logits` (not in vLLM): the float32 logits of every prompt
      position (the request then recomputes its prompt instead of reading the prefix cache) and
      of every generated token.
    """

    n: int = attrs.field(default=1, validator=positive_int)
    max_tokens: int | None = attrs.field(default=16, validator=optional_positive_int)
    min_tokens: int = attrs.field(default=0, validator=non_negative_int)
    temperature: float = attrs.field(default=0.0, validator=non_negative)
    top_k: int = attrs.field(default=0, validator=_top_k)
    top_p: float = attrs.field(default=1.0, validator=_top_p)
    presence_penalty: float = attrs.field(default=0.0, validator=_between(-2.0, 2.0))
    frequency_penalty: float = attrs.field(default=0.0, validator=_between(-2.0, 2.0))
    repetition_penalty: float = attrs.field(default=1.0, validator=positive)
    seed: int | None = attrs.field(default=None, validator=_int_or_none)
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stop_strings, validator=_strings)
    stop_token_ids: tuple[int, ...] = attrs.field(
        default=(), converter=_as_tuple, validator=_token_ids
    )
    ignore_eos: bool = attrs.field(default=False, validator=_boolean)
    logprobs: int | None = attrs.field(default=None, validator=_optional(non_negative_int))
    prompt_logits: bool = attrs.field(default=False, validator=_boolean)
    return_logits: bool = attrs.field(default=False, validator=_boolean)

    def __attrs_post_init__(self) -> None:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens must be <= max_tokens, got min_tokens="
                f"{self.min_tokens} and max_tokens={self.max_tokens}; lower min_tokens or raise "
                "max_tokens"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
