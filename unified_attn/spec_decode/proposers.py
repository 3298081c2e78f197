"""Speculative decoding: the n-gram (prompt lookup) drafter, the choice of drafter (n-gram or a
draft model, `draft_model.py`) and the settings they run with.

A drafter proposes up to `num_speculative_tokens` tokens for a request in decode; the next step
schedules them as extra query tokens after the request's last token (slots from
`allocate_slots(..., num_lookahead_tokens=k)`, never hashed or cached), the target model scores
all of them in the same forward, and `Sampler.verify` accepts a prefix of them plus one token of
its own. Rejected drafts are rolled back by the scheduler (`num_computed_tokens` moves back; the
slots they were written to are overwritten later).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

from unified_attn.managers import StateManager
from unified_attn.request import Request, RequestStatus
from unified_attn.runner.model_source import ModelSource, state_cache_mode
from unified_attn.runner.scheduler import SchedulerOutput
from unified_attn.runner.worker import Worker
from unified_attn.spec_decode.draft_model import (
    DraftModelProposer,
    load_draft_model,
    split_kv_budget,
)
from unified_attn.utils import positive_int

SPECULATIVE_METHODS = ("ngram", "draft")


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

    def draft(self, requests: Sequence[tuple[Request, int]]) -> None:
        """Set `spec_token_ids` of each `(request, limit)` (see `propose`)."""
        for request, limit in requests:
            request.spec_token_ids = self.propose(request.all_token_ids, limit)

    def _lookup(self, tokens: np.ndarray, limit: int) -> list[int]:
        """What followed the longest recurring suffix ([] if none recurs)."""
        longest = min(self.prompt_lookup_max, len(tokens) - 1)
        for n in range(longest, self.prompt_lookup_min - 1, -1):
            start = _earlier_match(tokens, n, limit)
            if start is not None:
                return tokens[start + n : start + n + limit].tolist()
        return []


Drafter = NgramProposer | DraftModelProposer


def _earlier_match(tokens: np.ndarray, n: int, follow: int) -> int | None:
    """Start of an earlier occurrence of the last `n` tokens (not the suffix itself): the
    latest one followed by `follow` tokens, else the latest one; None if there is none."""
    windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # every earlier n-gram
    hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
    if not len(hits):
        return None
    full = hits[hits + n + follow <= len(tokens)]
    return int(full[-1]) if len(full) else int(hits[-1])


def check_speculative_options(
    method: str | None,
    num_speculative_tokens: int | None,
    draft_model: str | None,
    *,
    model_kind: str,
    state_groups: list[str],
    mamba_cache_mode: str = "none",
) -> None:
    """A `ValueError` naming the option for settings or models speculative decoding cannot
    serve; nothing when the options ask for no speculation or for one it can run."""
    methods = ", ".join(SPECULATIVE_METHODS)
    if method is None:
        if num_speculative_tokens is not None or draft_model is not None:
            given = "draft_model" if draft_model is not None else "num_speculative_tokens"
            raise ValueError(
                f"{given} needs speculative_method; pass speculative_method='ngram' or 'draft' "
                f"(methods: {methods})"
            )
        return
    if method not in SPECULATIVE_METHODS:
        raise ValueError(
            f"speculative_method={method!r} is not supported; the methods are {methods} "
            "(prompt lookup, a draft model)"
        )
    if (method == "draft") != (draft_model is not None):
        raise ValueError(
            "speculative_method='draft' needs draft_model (a preset or checkpoint sharing the "
            "target's tokenizer)"
            if draft_model is None
            else f"draft_model={draft_model!r} needs speculative_method='draft', got {method!r}"
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
    if state_groups and mamba_cache_mode != "none":
        raise ValueError(
            f"speculative decoding over state layers (KV-cache groups {state_groups}) needs "
            f"mamba_cache_mode='none', got {mamba_cache_mode!r}: a rejected draft is rolled "
            "back to the state slot of the last kept token, and prefix checkpoints keep no such "
            "slots; leave mamba_cache_mode unset (it is then 'none' with speculation)"
        )


def build_drafter(
    config: Any, source: ModelSource, worker: Worker, device: torch.device
) -> Drafter | None:
    """The drafter `config` (an `EngineConfig`) asks for, or None. A draft model gets its own
    KV cache: `worker` (the target's, not sized yet) gives it its share of the budget, so call
    this before sizing the target's cache."""
    check_speculative_options(
        config.speculative_method,
        config.num_speculative_tokens,
        config.draft_model,
        model_kind=source.kind,
        state_groups=[
            f"{gid} ({g.manager_cls.__name__})"
            for gid, g in enumerate(worker.plan.groups)
            if issubclass(g.manager_cls, StateManager)
        ],
        mamba_cache_mode=state_cache_mode(config),
    )
    k = config.num_speculative_tokens
    if config.speculative_method is None:
        return None
    if config.speculative_method == "ngram":
        return NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max)
    draft_source, draft_worker = load_draft_model(config, source, worker.max_model_len, device)
    split_kv_budget(worker, draft_worker)
    try:
        draft_worker.allocate(draft_worker.determine_num_blocks())
    except ValueError as error:
        raise ValueError(f"draft_model={config.draft_model!r}: {error}") from None
    return DraftModelProposer(
        draft_source,
        draft_worker,
        name=config.draft_model,
        num_speculative_tokens=k,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        seed=config.seed,
        cuda_graphs=config.cuda_graphs,
    )


def propose_drafts(drafter: Drafter, output: SchedulerOutput, max_model_len: int) -> None:
    """After a step: draft tokens for the next step of every running request of `output` that
    decodes, within `max_model_len` and its `max_tokens` (the step adds one token more)."""
    requests = []
    for entry in output.scheduled:
        request = entry.request
        if request.status != RequestStatus.RUNNING or not entry.will_sample:
            continue
        room = max_model_len - request.num_tokens
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        requests.append((request, room))
    drafter.draft(requests)
