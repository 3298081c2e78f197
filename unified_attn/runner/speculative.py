"""Speculative decoding: the n-gram (prompt lookup) drafter and the settings it runs with.

A drafter proposes up to `num_speculative_tokens` tokens for a request in decode; the next step
schedules them as extra query tokens after the request's last token (slots from
`allocate_slots(..., num_lookahead_tokens=k)`, never hashed or cached), the target model scores
all of them in the same forward, and `Sampler.verify` accepts a prefix of them plus one token of
its own. Rejected drafts are rolled back by the scheduler (`num_computed_tokens` moves back; the
slots they were written to are overwritten later).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from unified_attn.request import RequestStatus
from unified_attn.runner.scheduler import SchedulerOutput
from unified_attn.utils import positive_int

SPECULATIVE_METHODS = ("ngram",)


@attrs.frozen
class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens
    (n from `prompt_lookup_max` down to `prompt_lookup_min`) and propose the tokens that
    followed it. Costs no model call; pays off on text that repeats its context (code edits,
    summaries that copy, retrieval answers)."""

    num_speculative_tokens: int = attrs.field(validator=positive_int)
    prompt_lookup_min: int = attrs.field(default=1, validator=positive_int)
    prompt_lookup_max: int = attrs.field(default=4, validator=positive_int)

    def __attrs_post_init__(self) -> None:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"NgramProposer: prompt_lookup_min={self.prompt_lookup_min} is more than "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )

    def propose(self, token_ids: Sequence[int], max_tokens: int | None = None) -> list[int]:
        """Exactly `min(num_speculative_tokens, max_tokens)` draft tokens to follow `token_ids`:
        what followed the longest recurring suffix (of its occurrences, the latest followed by
        enough tokens, else the latest), padded with repeats of its last token (without a
        recurring suffix: repeats of the sequence's last token). A fixed draft count keeps
        decode steps uniform, so they replay one captured CUDA graph; verifying a wrong guess
        costs little in a step that
        reads the weights anyway."""
        limit = self.num_speculative_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens)
        tokens = np.asarray(token_ids, dtype=np.int64)
        if limit <= 0 or not len(tokens):
            return []
        drafts = self._lookup(tokens, limit)
        if not drafts:
            drafts = [int(tokens[-1])]
        return drafts + [drafts[-1]] * (limit - len(drafts))

    def _lookup(self, tokens: np.ndarray, limit: int) -> list[int]:
        """What followed the longest recurring suffix ([] if none recurs)."""
        longest = min(self.prompt_lookup_max, len(tokens) - 1)
        for n in range(longest, self.prompt_lookup_min - 1, -1):
            start = _earlier_match(tokens, n, limit)
            if start is not None:
                return tokens[start + n : start + n + limit].tolist()
        return []


def _earlier_match(tokens: np.ndarray, n: int, follow: int) -> int | None:
    """Start of an earlier occurrence of the last `n` tokens (not the suffix itself): the
    latest one followed by `follow` tokens, else the latest one; None if there is none."""
    windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # every earlier n-gram
    hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
    if not len(hits):
        return None
    full = hits[hits + n + follow <= len(tokens)]
    return int(full[-1]) if len(full) else int(hits[-1])


def make_drafter(
    method: str | None,
    num_speculative_tokens: int | None,
    prompt_lookup_min: int,
    prompt_lookup_max: int,
    *,
    model_kind: str,
    state_groups: list[str],
) -> NgramProposer | None:
    """The drafter an engine's options ask for, or None; a `ValueError` naming the option for
    settings or models it cannot serve."""
    if method is None:
        if num_speculative_tokens is not None:
            raise ValueError(
                f"num_speculative_tokens={num_speculative_tokens} needs speculative_method; "
                f"pass speculative_method='ngram' (methods: {', '.join(SPECULATIVE_METHODS)})"
            )
        return None
    if method not in SPECULATIVE_METHODS:
        raise ValueError(
            f"speculative_method={method!r} is not supported; the methods are "
            f"{', '.join(SPECULATIVE_METHODS)} (prompt lookup; a draft model is not supported)"
        )
    if (
        isinstance(num_speculative_tokens, bool)
        or not isinstance(num_speculative_tokens, int)
        or (num_speculative_tokens <= 0)
    ):
        raise ValueError(
            f"speculative_method={method!r} needs num_speculative_tokens, a positive int, got "
            f"{num_speculative_tokens!r}; 3 to 5 is typical"
        )
    if model_kind != "decoder":
        raise ValueError(
            f"speculative decoding serves decoder-only models; this model is "
            f"{model_kind.replace('_', '-')}: drop speculative_method"
        )
    if state_groups:
        raise ValueError(
            f"speculative decoding cannot roll back rejected drafts in state layers (KV-cache "
            f"groups {state_groups} keep one recurrent state per request): drop "
            "speculative_method for this model"
        )
    return NgramProposer(num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)


def propose_drafts(drafter: NgramProposer, output: SchedulerOutput, max_model_len: int) -> None:
    """After a step: draft tokens for the next step of every running request of `output` that
    decodes, within `max_model_len` and its `max_tokens` (the step adds one token more)."""
    for entry in output.scheduled:
        request = entry.request
        if request.status != RequestStatus.RUNNING or not entry.will_sample:
            continue
        room = max_model_len - request.num_tokens
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        request.spec_token_ids = drafter.propose(request.all_token_ids, room)
