"""Request intake: what `LLMEngine` checks and builds before it queues a request. The sampling
parameters are checked against the model (`check_params`) and paired with a batch's prompts
(`params_per_prompt`); a request with `SamplingParams.n > 1` becomes `n` completions, each
with its own scheduler id (`child_ids`), parameters (`child_params`) and `SequenceState`
(`new_sequence`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import attrs

from unified_attn.engine.detokenizer import IncrementalText
from unified_attn.engine.prompts import ReadPrompt
from unified_attn.engine.sequences import ParentRequest, SequenceState
from unified_attn.request import Request
from unified_attn.sampling_params import RequestOutputKind, SamplingParams


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
    if params.bad_words and tokenizer is None:
        raise ValueError(
            f"{what}: SamplingParams.bad_words={list(params.bad_words)} needs a tokenizer to "
            "spell the words and this model has none; ban token ids with logit_bias instead"
        )
    for word in params.bad_words:
        if not tokenizer.encode(word.lstrip()):
            raise ValueError(f"{what}: SamplingParams.bad_words: {word!r} spells no token; drop it")
    for field, ids in (
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias", list(params.logit_bias or ())),
        ("allowed_token_ids", params.allowed_token_ids or ()),
    ):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(
                f"{what}: SamplingParams.{field} holds {bad[0]}, outside the vocabulary "
                f"[0, {vocab_size}); drop it"
            )
    for field in ("logprobs", "prompt_logprobs"):
        value = getattr(params, field)
        if value is not None and value > vocab_size:
            raise ValueError(
                f"{what}: SamplingParams.{field}={value} exceeds the vocabulary size "
                f"{vocab_size}; ask for at most {vocab_size} (prompt_logprobs=-1: all of it)"
            )


def bad_words_token_ids(bad_words: tuple[str, ...], tokenizer: Any) -> list[list[int]]:
    """vLLM's spelling of `bad_words`: each word as tokenized alone, and with a leading space
    when that gives other tokens of the same count (a word inside the text)."""
    out: list[list[int]] = []
    for word in bad_words:
        plain = tokenizer.encode(word.lstrip())  # no special tokens (check_params: not empty)
        out.append(list(plain))
        spaced = tokenizer.encode(" " + word.lstrip())
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(list(spaced))
    return out


def check_request_id(request_id: Any, prompt: Any) -> None:
    """`add_request(request_id, prompt, params)`, vLLM's order: an id that is not a non-empty
    str (or None), or a missing prompt, raises `ValueError` saying so."""
    if request_id is not None and not (isinstance(request_id, str) and request_id):
        raise ValueError(
            f"add_request: request_id must be a non-empty str or None (the engine picks one), "
            f"got {request_id!r}; the call is add_request(request_id, prompt, params), as in vLLM"
        )
    if prompt is None:
        raise ValueError(
            "add_request: no prompt given; the call is add_request(request_id, prompt, params), "
            "as in vLLM (request_id may be None)"
        )


def request_id_list(request_ids: Any) -> list[str]:
    """`abort_request`'s argument, one id or an iterable of them, as a list of str; anything
    else raises `ValueError` before any request is aborted."""
    ids = [request_ids] if isinstance(request_ids, str) else request_ids
    try:
        ids = list(ids)
    except TypeError:
        ids = [request_ids]
    bad = [i for i in ids if not isinstance(i, str)]
    if bad:
        raise ValueError(
            f"abort_request: request ids must be str, got {bad[0]!r}; pass one id or a list of "
            "ids"
        )
    return ids


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


def new_parent(request_id: str, read: ReadPrompt, output_kind: RequestOutputKind) -> ParentRequest:
    """A request as its caller sees it, before its completions are added."""
    return ParentRequest(
        request_id, read.text, read.token_ids, read.encoder_text, read.encoder_token_ids,
        output_kind=output_kind, arrival_time=time.time(),
    )  # fmt: skip


def new_request(
    request_id: str,
    prompt: PreparedPrompt,
    index: int,
    block_hasher: Any,
    cache_salt: str | None,
    tokenizer: Any,
) -> Request:
    """The scheduler request of completion `index` of `prompt`."""
    params = child_params(prompt.params, index)
    request = Request(
        request_id,
        prompt.read.token_ids,
        block_hasher=block_hasher,
        cache_salt=cache_salt,
        sampling_params=params,
        encoder_token_ids=prompt.read.encoder_token_ids,
    )
    request.skip_reading_prefix_cache = params.needs_prompt_rows
    if params.bad_words:
        request.bad_words_token_ids = bad_words_token_ids(params.bad_words, tokenizer)
    return request


def new_sequence(
    parent_id: str, index: int, request: Request, tokenizer: Any, *, incremental: bool
) -> SequenceState:
    """Completion `index` of request `parent_id`, before its first step: its text is read with
    `tokenizer` (none without one), step by step when it is `incremental` (streamed, or its
    outputs come before it finishes) or has stop strings, and
    its log-probabilities are gathered if its parameters ask for them."""
    params: SamplingParams = request.sampling_params
    text = None
    if tokenizer is not None:
        text = IncrementalText(tokenizer, params)
    wants_logprobs = params.logprobs is not None
    return SequenceState(
        parent_id,
        index,
        request,
        text,
        incremental=incremental or bool(params.stop),
        logprobs=[] if wants_logprobs else None,
        cumulative_logprob=0.0 if wants_logprobs else None,
    )
