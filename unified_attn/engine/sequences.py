"""The engine's per-request state: a `ParentRequest` (what a caller added: one id, one prompt)
with its `n` `SequenceState`s (one scheduler request each), and how their outputs are
assembled."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from unified_attn.engine.detokenizer import IncrementalText
from unified_attn.engine.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from unified_attn.request import Request, RequestStatus
from unified_attn.runner.logprobs import TokenLogprobs
from unified_attn.sampling_params import RequestOutputKind

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@attrs.define(eq=False)
class SequenceState:
    """One completion: its scheduler request and what the engine gathered for it so far."""

    parent_id: str
    index: int
    request: Request
    text: IncrementalText | None  # None without a tokenizer
    incremental: bool  # text read step by step (stop strings, streams), else once at the end
    logprobs: SampleLogprobs | None
    cumulative_logprob: float | None
    prompt_logits: list[torch.Tensor] = attrs.Factory(list)
    prompt_logprobs: list[TokenLogprobs] = attrs.Factory(list)  # prompt positions 1, 2, ...
    sample_logits: list[torch.Tensor] = attrs.Factory(list)
    num_seen: int = 0  # output tokens already gathered
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@attrs.define(eq=False)
class ParentRequest:
    """A request as its caller sees it: one id, one prompt, `n` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    sequences: list[SequenceState] = attrs.Factory(list)
    # what `step()` returns for it (`generate` always takes FINAL_ONLY; a stream, deltas)
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY
    arrival_time: float = 0.0  # wall clock, when it was added
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_outputs: int = 0  # outputs `step()` has returned for it

    def counts(self) -> tuple[int, int]:
        """(output tokens, preemptions) of all its sequences."""
        requests = [seq.request for seq in self.sequences]
        return sum(r.num_output_tokens for r in requests), sum(r.num_preemptions for r in requests)

    @property
    def done(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)


@attrs.frozen
class Progress:
    """What one step added to one sequence: its new token ids and their log-probabilities."""

    seq: SequenceState
    token_ids: list[int]
    logprobs: SampleLogprobs | None


def logprob_entry(lp: TokenLogprobs, tokenizer: Any) -> dict[int, Logprob]:
    """vLLM's entry of one position: the chosen token first, then the top-k."""

    def text(token_id: int) -> str | None:
        return None if tokenizer is None else tokenizer.decode([token_id])

    entry = {lp.token_id: Logprob(lp.logprob, lp.rank, text(lp.token_id))}
    pairs = zip(lp.top_token_ids, lp.top_logprobs, strict=True)
    for rank, (token_id, value) in enumerate(pairs, start=1):
        entry.setdefault(token_id, Logprob(value, rank, text(token_id)))
    return entry


def gather_logprobs(
    seq: SequenceState, lps: Sequence[TokenLogprobs], tokenizer: Any
) -> SampleLogprobs | None:
    """Record the new tokens' log-probabilities (each: the sampled token, then the top-k) in
    `seq`; returns them as the tokens' entries for a stream delta."""
    if seq.logprobs is None or seq.cumulative_logprob is None:
        return None
    entries = []
    for lp in lps:
        entry = logprob_entry(lp, tokenizer)
        seq.logprobs.append(entry)
        seq.cumulative_logprob += lp.logprob
        entries.append(entry)
    return entries


def request_output(parent: ParentRequest, tokenizer: Any) -> RequestOutput:
    """The finished request as its caller sees it."""
    return _output(parent, [completion_output(seq) for seq in parent.sequences], tokenizer)


def progress_output(parent: ParentRequest, steps: list[Progress], tokenizer: Any) -> RequestOutput:
    """A CUMULATIVE or DELTA request after a step: the completions it advanced, each whole so
    far or what the step added (vLLM's streaming outputs); `finished` once all have ended."""
    delta = parent.output_kind == RequestOutputKind.DELTA
    return _output(parent, [partial_completion(step, delta) for step in steps], tokenizer)


def _output(
    parent: ParentRequest, outputs: list[CompletionOutput], tokenizer: Any
) -> RequestOutput:
    """A `RequestOutput` of `outputs`; in DELTA mode the prompt's logits and log-probabilities
    come once, with its first output."""
    first, head = outputs[0], parent.sequences[0]
    once = parent.output_kind != RequestOutputKind.DELTA or parent.num_outputs == 0
    parent.num_outputs += 1
    prompt_logprobs = None
    if head.request.sampling_params.prompt_logprobs is not None and once:
        prompt_logprobs = [None, *(logprob_entry(lp, tokenizer) for lp in head.prompt_logprobs)]
    num_tokens, num_preemptions = parent.counts()
    metrics = RequestMetrics(parent.arrival_time, parent.first_token_time,
                             parent.last_token_time, num_tokens, num_preemptions)  # fmt: skip
    return RequestOutput(
        parent.request_id,
        parent.prompt_token_ids,
        first.token_ids,
        first.finish_reason,
        first.text,
        num_preemptions,
        torch.cat(head.prompt_logits) if head.prompt_logits and once else None,
        first.logits,
        prompt=parent.prompt,
        outputs=outputs,
        finished=parent.done,
        encoder_prompt_token_ids=parent.encoder_prompt_token_ids,
        encoder_prompt=parent.encoder_prompt,
        prompt_logprobs=prompt_logprobs,
        num_cached_tokens=max(head.request.num_cached_tokens, 0),
        metrics=metrics,
    )


def partial_completion(step: Progress, delta: bool) -> CompletionOutput:
    """One completion as a step left it: cumulative, or only what the step added."""
    seq, finished = step.seq, step.seq.finish_reason is not None
    text = None
    if seq.text is not None:
        text = seq.text.delta(finished) if delta else seq.text.visible(finished)
    logits = torch.cat(seq.sample_logits) if seq.sample_logits else None
    if delta:
        token_ids, logprobs = step.token_ids, step.logprobs
        logits = None if logits is None else logits[len(logits) - len(token_ids) :]
    else:
        token_ids = list(seq.request.output_token_ids)
        logprobs = None if seq.logprobs is None else list(seq.logprobs)
    return CompletionOutput(
        seq.index, text, token_ids, seq.cumulative_logprob, logprobs, seq.finish_reason,
        seq.stop_reason, logits,
    )  # fmt: skip


def completion_output(seq: SequenceState) -> CompletionOutput:
    """One finished completion; its text is read once here unless it was read step by step."""
    request = seq.request
    if seq.text is not None and not seq.incremental:
        ids = request.output_token_ids
        if seq.finish_reason == "stop" and not seq.text.include_stop:
            ids = ids[:-1]  # ended by EOS or a stop token: not in the text
        seq.text.add(ids, request.num_output_tokens, final=True)
    return CompletionOutput(
        seq.index,
        None if seq.text is None else seq.text.text,
        request.output_token_ids,
        seq.cumulative_logprob,
        seq.logprobs,
        seq.finish_reason,
        seq.stop_reason,
        torch.cat(seq.sample_logits) if seq.sample_logits else None,
    )
