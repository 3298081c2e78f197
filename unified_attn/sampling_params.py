"""Per-request generation parameters, named and defined as in vLLM (a leaf module: the scheduler
and engine import it)."""

from __future__ import annotations

import enum
import math
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


def _between(low: float, high: float) -> _Check:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not (_is_number(value) and low <= value <= high):
            _fail(instance, attribute, f"a number in [{low:g}, {high:g}]", value)

    return check


MAX_SEED = 2**63 - 1  # what a torch.Generator takes


def _seed(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not (_is_int(value) and 0 <= value <= MAX_SEED):
        _fail(instance, attribute, f"None or an int in [0, {MAX_SEED}]", value)


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


def _prompt_logprobs(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not (_is_int(value) and value >= -1):
        _fail(instance, attribute, "None, an int >= 0, or -1 for the whole vocabulary", value)


def _logit_bias(value: Any) -> Any:
    """A mapping becomes a dict (token ids given as strings, as JSON has them, become ints)."""
    if not isinstance(value, dict):
        return value
    try:
        return {int(token): bias for token, bias in value.items()}
    except (TypeError, ValueError):
        return value  # the validator names the key


def _biases(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict) or not all(_is_int(t) and t >= 0 for t in value):
        _fail(instance, attribute, "None or a dict {token id (int >= 0): bias}", value)
    bad = {t: b for t, b in value.items() if not (_is_number(b) and -100.0 <= b <= 100.0)}
    if bad:
        token, bias = next(iter(bad.items()))
        what = f"a bias in [-100, 100] for token {token} (vLLM clamps to that range)"
        _fail(instance, attribute, what, bias)


def _allowed(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    _token_ids(instance, attribute, value)
    if not value:
        _fail(instance, attribute, "None or a non-empty list of token ids", list(value))


def _finite(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not (_is_number(value) and math.isfinite(value)):
        _fail(instance, attribute, "a finite number", value)


def _chain(*checks: _Check) -> _Check:
    def run(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        for check in checks:
            check(instance, attribute, value)

    return run


def _output_kind(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, RequestOutputKind):
        _fail(instance, attribute, "a RequestOutputKind (CUMULATIVE, DELTA, FINAL_ONLY)", value)


class RequestOutputKind(enum.Enum):
    """What `LLMEngine.step()` returns for a request (vLLM's enum): its whole output so far
    every step it advances (CUMULATIVE), what the step added (DELTA), or one output when it
    finishes (FINAL_ONLY; what `generate` always uses)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


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
    - `prompt_logprobs`: for every prompt position after the first, the log-probability of the
      prompt's token there and of the `prompt_logprobs` most likely tokens (-1: the whole
      vocabulary); the request recomputes its prompt instead of reading the prefix cache.
    - `min_p`: after temperature, drop the tokens whose probability is below `min_p` times the
      most likely token's (vLLM applies it before top-k and top-p; greedy ignores it).
    - `logit_bias` (token id -> bias in [-100, 100]), `allowed_token_ids` (only these can be
      sampled) and `bad_words` (a word's last token is masked when the output so far ends with
      the rest of it, with and without a leading space) change the logits before the penalties,
      greedy requests included: allowed ids, then bad words, `min_tokens`, then the bias.
    - `skip_special_tokens` (default True), `spaces_between_special_tokens`: how the text is
      decoded. `include_stop_str_in_output`: keep the stop string (or the stop token's text) at
      the end of the text.
    - `output_kind`: what `LLMEngine.step()` returns for the request (`RequestOutputKind`).
    - `prompt_logits`, `return_logits` (not in vLLM): the float32 logits of every prompt
      position (the request then recomputes its prompt instead of reading the prefix cache) and
      of every generated token.
    """

    n: int = attrs.field(default=1, validator=positive_int)
    max_tokens: int | None = attrs.field(default=16, validator=optional_positive_int)
    min_tokens: int = attrs.field(default=0, validator=non_negative_int)
    temperature: float = attrs.field(default=0.0, validator=_chain(non_negative, _finite))
    top_k: int = attrs.field(default=0, validator=_top_k)
    top_p: float = attrs.field(default=1.0, validator=_top_p)
    min_p: float = attrs.field(default=0.0, validator=_between(0.0, 1.0))
    presence_penalty: float = attrs.field(default=0.0, validator=_between(-2.0, 2.0))
    frequency_penalty: float = attrs.field(default=0.0, validator=_between(-2.0, 2.0))
    repetition_penalty: float = attrs.field(default=1.0, validator=_chain(positive, _finite))
    seed: int | None = attrs.field(default=None, validator=_optional(_seed))
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stop_strings, validator=_strings)
    stop_token_ids: tuple[int, ...] = attrs.field(
        default=(), converter=_as_tuple, validator=_token_ids
    )
    ignore_eos: bool = attrs.field(default=False, validator=_boolean)
    logprobs: int | None = attrs.field(default=None, validator=_optional(non_negative_int))
    prompt_logprobs: int | None = attrs.field(default=None, validator=_optional(_prompt_logprobs))
    logit_bias: dict[int, float] | None = attrs.field(
        default=None, converter=_logit_bias, validator=_biases, hash=False
    )
    allowed_token_ids: tuple[int, ...] | None = attrs.field(
        default=None, converter=attrs.converters.optional(_as_tuple), validator=_allowed
    )
    bad_words: tuple[str, ...] = attrs.field(
        default=(), converter=_stop_strings, validator=_strings
    )
    skip_special_tokens: bool = attrs.field(default=True, validator=_boolean)
    spaces_between_special_tokens: bool = attrs.field(default=True, validator=_boolean)
    include_stop_str_in_output: bool = attrs.field(default=False, validator=_boolean)
    output_kind: RequestOutputKind = attrs.field(
        default=RequestOutputKind.CUMULATIVE, validator=_output_kind
    )
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
    def needs_prompt_rows(self) -> bool:
        """Whether every prompt position's logits are needed (`prompt_logits`,
        `prompt_logprobs`): the prompt is then recomputed, not read from the prefix cache."""
        return self.prompt_logits or self.prompt_logprobs is not None

    @property
    def changes_logits(self) -> bool:
        """Whether `allowed_token_ids`, `bad_words` or `logit_bias` act on the logits."""
        return self.allowed_token_ids is not None or bool(self.bad_words or self.logit_bias)

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
