"""Per-request generation parameters (a leaf module: the scheduler and engine import it)."""

from __future__ import annotations

import attrs

from unified_attn.utils import non_negative, non_negative_int, positive_int


@attrs.frozen
class SamplingParams:
    """`temperature == 0` is greedy. `top_k == 0` and `top_p == 1` disable those filters."""

    max_tokens: int = attrs.field(default=16, validator=positive_int)
    temperature: float = attrs.field(default=0.0, validator=non_negative)
    top_k: int = attrs.field(default=0, validator=non_negative_int)
    top_p: float = attrs.field(default=1.0)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    ignore_eos: bool = False
    # Return the float32 logits of every prompt position (disables prefix-cache reads for the
    # request) and/or of every generated token.
    prompt_logits: bool = False
    return_logits: bool = False

    @top_p.validator
    def _check_top_p(self, _attribute: attrs.Attribute, value: float) -> None:
        if not 0.0 < value <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
