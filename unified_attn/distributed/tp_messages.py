"""What rank 0 sends the other tensor-parallel ranks each step, and how they read it.

Rank 0's `Mirror` turns a `SchedulerOutput` into a compact `StepMessage`: the requests the
other ranks have not seen (`NewRequest`: prompt and sampling parameters), the tokens each
request gained since the last message, the scheduled entries without their requests (`Entry`
fields as plain tuples), and the preempted and finished ids. `distributed/tp_codec.py` turns a
message into bytes and back (a typed, versioned format, never pickle), which
`distributed/tp_group.py` broadcasts in one fixed-size collective when they fit
`MESSAGE_BYTES`. Every other rank's `Replica` applies the message to its
copies of the requests and rebuilds the same `SchedulerOutput`. The two stay in step as long
as every message rank 0 makes is applied, in order, on every rank.

Overlapped steps (`engine/step_loop.py`): a replica holds exactly the tokens rank 0's request
holds when the step is launched (the message is made then, from them), so a token still in
flight on rank 0 (its id on the device) is missing from the replica too, and every rank's runner
reads it from its own device (`start >= request.num_tokens` in `ModelRunner._layout`): the
message needs no per-entry flag for it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import attrs

from unified_attn.request import Request
from unified_attn.runner.scheduler import ScheduledRequest, SchedulerOutput
from unified_attn.sampling_params import SamplingParams


@attrs.frozen
class NewRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None


class Entry(NamedTuple):
    """A `ScheduledRequest` without its request. Decoded as a plain tuple of these fields (built
    in C by `zip`); `Replica` names them."""

    request_id: str
    num_new_tokens: int
    num_computed_before: int
    block_ids: tuple[list[int], ...]
    is_new: bool
    will_sample: bool
    spec_token_ids: tuple[int, ...]
    # the request's state slot (state layers under speculative decoding), which rank 0's
    # scheduler keeps: `Request.state_column`
    state_column: int


@attrs.frozen
class StepMessage:
    new: list[NewRequest]
    tokens: dict[str, list[int]]  # tokens to append to a request's copy
    entries: list[tuple[Any, ...]]  # `Entry` fields, as plain tuples
    preempted_ids: list[str]
    finished_ids: list[str]
    # rank 0 launched the step overlapped (`ModelRunner.launch`): every rank launches it and
    # keeps its sampled ids on the device for the next step; else a plain step, whose tokens
    # are rank 0's (`tp_group.run_step`)
    launch: bool = False


class Mirror:
    """Rank 0's record of the tokens each other rank holds, to send only what is new."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}

    def message(self, output: SchedulerOutput, launch: bool = False) -> StepMessage:
        preempted = [r.request_id for r in output.preempted]
        for rid in output.finished_ids:
            if rid not in preempted:
                self.sent.pop(rid, None)
        new, tokens, entries = [], {}, []
        for s in output.scheduled:
            request, rid = s.request, s.request.request_id
            if rid not in self.sent:
                new.append(NewRequest(rid, request.prompt_token_ids, request.sampling_params))
                self.sent[rid] = request.num_prompt_tokens
            if request.num_tokens > self.sent[rid]:
                tokens[rid] = request.all_token_ids[self.sent[rid] :]
                self.sent[rid] = request.num_tokens
            entries.append(
                (
                    rid,
                    s.num_new_tokens,
                    s.num_computed_before,
                    s.block_ids,
                    s.is_new,
                    s.will_sample,
                    s.spec_token_ids,
                    request.state_column,
                )
            )
        return StepMessage(new, tokens, entries, preempted, list(output.finished_ids), launch)


class Replica:
    """A rank's copies of the requests, rebuilt into `SchedulerOutput`s from messages."""

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}

    def output(self, message: StepMessage) -> SchedulerOutput:
        for rid in message.finished_ids:
            if rid not in message.preempted_ids:
                self.requests.pop(rid, None)
        for new in message.new:
            self.requests[new.request_id] = Request(
                new.request_id, new.prompt_token_ids, sampling_params=new.sampling_params
            )
        for rid, tokens in message.tokens.items():
            self.requests[rid].append_output_token_ids(tokens)
        scheduled = []
        for entry in map(Entry._make, message.entries):
            request = self.requests[entry.request_id]
            request.state_column = entry.state_column
            scheduled.append(ScheduledRequest(request, *entry[1:-1]))
        preempted = [self.requests[rid] for rid in message.preempted_ids if rid in self.requests]
        return SchedulerOutput(scheduled, preempted, message.finished_ids)


MESSAGE_BYTES = 1 << 14  # a decode step of a few hundred requests fits; larger ones take two
