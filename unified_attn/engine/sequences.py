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
    RequestOutput,
    SampleLogprobs,
)
from unified_attn.request import Request, RequestStatus
from unified_attn.runner.sampler import TokenLogprobs

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

    @property
    def done(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)


def gather_logprobs(
    seq: SequenceState, lps: Sequence[TokenLogprobs], tokenizer: Any
) -> SampleLogprobs | None:
    """Record the new tokens' log-probabilities (each: the sampled token, then the top-k) in
    `seq`; returns them as the tokens' entries for a stream delta."""
    if seq.logprobs is None or seq.cumulative_logprob is None:
        return None

    def text(token_id: int) -> str | None:
        return None if tokenizer is None else tokenizer.decode([token_id])

    entries = []
    for lp in lps:
        entry = {lp.token_id: Logprob(lp.logprob, lp.rank, text(lp.token_id))}
        pairs = zip(lp.top_token_ids, lp.top_logprobs, strict=True)
        for rank, (token_id, value) in enumerate(pairs, start=1):
            entry.setdefault(token_id, Logprob(value, rank, text(token_id)))
        seq.logprobs.append(entry)
        seq.cumulative_logprob += lp.logprob
        entries.append(entry)
    return entries


def request_output(parent: ParentRequest) -> RequestOutput:
    """The finished request as its caller sees it."""
    outputs = [completion_output(seq) for seq in parent.sequences]
    first, prompt_parts = outputs[0], parent.sequences[0].prompt_logits
    return RequestOutput(
        parent.request_id,
        parent.prompt_token_ids,
        first.token_ids,
        first.finish_reason,
        first.text,
        sum(seq.request.num_preemptions for seq in parent.sequences),
        torch.cat(prompt_parts) if prompt_parts else None,
        first.logits,
        prompt=parent.prompt,
        outputs=outputs,
        encoder_prompt_token_ids=parent.encoder_prompt_token_ids,
        encoder_prompt=parent.encoder_prompt,
    )


def completion_output(seq: SequenceState) -> CompletionOutput:
    """One finished completion; its text is read once here unless it was read step by step."""
    request = seq.request
    if seq.text is not None and not seq.incremental:
        ids = request.output_token_ids
        if seq.finish_reason == "stop":  # ended by EOS or a stop token: not in the text
            ids = ids[:-1]
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
