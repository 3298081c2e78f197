"""Request intake: what `LLMEngine` checks and builds before it queues a request. The sampling
parameters are checked against the model (`check_params`) and paired with a batch's prompts
(`params_per_prompt`); a request with `SamplingParams.n > 1` becomes `n` completions, each
with its own scheduler id (`child_ids`), parameters (`child_params`) and `SequenceState`
(`new_sequence`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from unified_attn.engine.detokenizer import IncrementalText
from unified_attn.engine.prompts import ReadPrompt
from unified_attn.engine.sequences import SequenceState
from unified_attn.request import Request
from unified_attn.sampling_params import SamplingParams


@attrs.frozen
class PreparedPrompt:
    """A validated prompt: its token ids (and the encoder's), its text if given as text, and
    its parameters."""

    read: ReadPrompt
    params: SamplingParams


def check_params(what: str, params: Any, tokenizer: Any, vocab_size: int) -> None:
    """What `SamplingParams` cannot check alone: it needs the model's tokenizer (or None) or
    vocab. Raises `ValueError` naming `what` for anything the model cannot honour."""
    if not isinstance(params, SamplingParams):
        raise ValueError(
            f"{what}: expected SamplingParams, got {type(params).__name__}; build one with "
            "SamplingParams(max_tokens=..., ...)"
        )
    if params.stop and tokenizer is None:
        raise ValueError(
            f"{what}: SamplingParams.stop={list(params.stop)} needs a tokenizer to read the "
            "text and this model has none; use stop_token_ids, or a checkpoint that ships "
            "tokenizer files"
        )
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise ValueError(
            f"{what}: SamplingParams.stop_token_ids holds {bad[0]}, outside the vocabulary "
            f"[0, {vocab_size}); drop it"
        )
    if params.logprobs is not None and params.logprobs > vocab_size:
        raise ValueError(
            f"{what}: SamplingParams.logprobs={params.logprobs} exceeds the vocabulary size "
            f"{vocab_size}; ask for at most {vocab_size}"
        )


def params_per_prompt(what: str, params: Any, num_prompts: int) -> list[Any]:
    """One entry per prompt of a batch: `params` (None, or one `SamplingParams`) repeated, or
    the caller's list of them, which must have one per prompt. The entries themselves are
    checked later (`check_params`); a wrong shape raises `ValueError` naming `what`."""
    if params is None or isinstance(params, SamplingParams):
        all_params = [params] * num_prompts
    elif isinstance(params, Sequence):
        all_params = list(params)
    else:
        raise ValueError(
            f"{what}: expected SamplingParams or a list of them, got {type(params).__name__}"
        )
    if len(all_params) != num_prompts:
        raise ValueError(
            f"{what}: got {len(all_params)} SamplingParams for {num_prompts} prompts; "
            "pass one SamplingParams, or one per prompt"
        )
    return all_params


def child_ids(request_id: str, n: int) -> list[str]:
    """The scheduler ids of a request's `n` completions: its own id alone, or `<id>#i`."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Completion `index` of `n`: one sequence, seeded `seed + index`."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return attrs.evolve(params, n=1, seed=seed)


def new_sequence(
    parent_id: str, index: int, request: Request, tokenizer: Any, *, streamed: bool
) -> SequenceState:
    """Completion `index` of request `parent_id`, before its first step: its text is read with
    `tokenizer` (none without one), step by step when it is `streamed` or has stop strings, and
    its log-probabilities are gathered if its parameters ask for them."""
    params: SamplingParams = request.sampling_params
    text = None
    if tokenizer is not None:
        text = IncrementalText(tokenizer, params.stop, params.min_tokens)
    wants_logprobs = params.logprobs is not None
    return SequenceState(
        parent_id,
        index,
        request,
        text,
        incremental=streamed or bool(params.stop),
        logprobs=[] if wants_logprobs else None,
        cumulative_logprob=0.0 if wants_logprobs else None,
    )
