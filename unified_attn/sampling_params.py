"""Per-request generation parameters (a leaf module: the scheduler and engine import it)."""

from __future__ import annotations

import attrs


def _non_negative(_instance: object, attribute: attrs.Attribute, value: float) -> None:
    if value < 0:
        raise ValueError(f"SamplingParams.{attribute.name} must be >= 0, got {value}")


@attrs.frozen
class SamplingParams:
    """`temperature == 0` is greedy. `top_k == 0` and `top_p == 1` disable those filters."""

    max_tokens: int = attrs.field(default=16)
    temperature: float = attrs.field(default=0.0, validator=_non_negative)
    top_k: int = attrs.field(default=0, validator=_non_negative)
    top_p: float = attrs.field(default=1.0)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    ignore_eos: bool = False
    # Return the float32 logits of every prompt position (disables prefix-cache reads for the
    # request) and/or of every generated token.
    prompt_logits: bool = False
    return_logits: bool = False

    @max_tokens.validator
    def _check_max_tokens(self, _attribute: attrs.Attribute, value: int) -> None:
        if value < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {value}")

    @top_p.validator
    def _check_top_p(self, _attribute: attrs.Attribute, value: float) -> None:
        if not 0.0 < value <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
