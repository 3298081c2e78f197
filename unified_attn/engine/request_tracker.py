"""`RequestTracker`: the engine's requests between queuing and output. It holds the unfinished
requests (`ParentRequest`s and their `SequenceState`s), turns every step's `StepResult` into
their progress (tokens, log-probabilities, logits, text and stop strings, stream deltas), and
keeps finished requests' `RequestOutput`s until the engine hands them out."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from unified_attn.engine.outputs import RequestOutput, SampleLogprobs, StreamDelta
from unified_attn.engine.sequences import (
    FINISH_REASONS,
    ParentRequest,
    Progress,
    SequenceState,
    gather_logprobs,
    progress_output,
    request_output,
)
from unified_attn.request import RequestStatus
from unified_attn.runner.scheduler import Scheduler, SchedulerOutput
from unified_attn.runner.step_inputs import StepResult
from unified_attn.sampling_params import RequestOutputKind


class RequestTracker:
    """Owned by `LLMEngine`: the requests it queued, by the id callers know, until their output.

    The engine queues a request's scheduler requests, then `add`s it. After every step it calls
    `keep_logits` and then `advance`, which finishes the requests whose sequences all ended:
    a streamed request's deltas went to its stream's queue, any other's `RequestOutput` waits
    for `take_all` / `take`. `abort` stops a request now, `drop` and `end_stream` forget
    requests whose caller is gone. Sequences stopped by a stop string, and aborted ones, are
    ended in the scheduler here.
    """

    def __init__(self, scheduler: Scheduler, tokenizer: Callable[[], Any]) -> None:
        self._scheduler = scheduler
        self._tokenizer_of = tokenizer  # the engine's tokenizer now (None: the model has none)
        self._parents: dict[str, ParentRequest] = {}  # unfinished requests, by the id callers know
        self._sequences: dict[str, SequenceState] = {}  # their scheduler requests, by request id
        # Finished requests' outputs not handed out yet: `step` returns them, `generate` takes
        # its own.
        self._outputs: list[RequestOutput] = []
        # Streamed requests: request id -> the queue of its stream (one queue per `stream`).
        self._stream_queues: dict[str, deque[StreamDelta]] = {}

    # ---- requests in ---------------------------------------------------------------------------

    def add(self, parent: ParentRequest, queue: deque[StreamDelta] | None) -> None:
        """Track a request whose sequences' scheduler requests are queued; `queue`, if given,
        gets its stream's deltas (and no `RequestOutput` is kept for it)."""
        for seq in parent.sequences:
            self._sequences[seq.request.request_id] = seq
        self._parents[parent.request_id] = parent
        if queue is not None:
            self._stream_queues[parent.request_id] = queue

    def check_new_ids(self, request_id: str, ids: list[str]) -> None:
        """Refuse a request id in use (an unfinished request's, or a scheduler request's)."""
        taken = [i for i in ids if i in self._scheduler.requests]
        if self.is_unfinished(request_id) or taken:
            raise ValueError(
                f"request id {(taken or [request_id])[0]!r} is already in use; pick another id "
                "or let the engine choose one"
            )

    def is_unfinished(self, request_id: str) -> bool:
        return request_id in self._parents

    def unfinished_ids(self) -> list[str]:
        """The unfinished requests' ids, in the order they were added."""
        return list(self._parents)

    @property
    def has_outputs(self) -> bool:
        """Whether finished requests' outputs wait to be handed out."""
        return bool(self._outputs)

    # ---- a step --------------------------------------------------------------------------------

    def keep_logits(
        self, output: SchedulerOutput, result: StepResult, appended: dict[str, int]
    ) -> None:
        """Keep the step's logits rows and prompt log-probabilities (`appended`: tokens each
        request kept); a preempted sequence's prompt rows are dropped, as its prompt is
        recomputed."""
        for request in output.preempted:
            seq = self._sequences.get(request.request_id)
            if seq is not None:  # the prompt is recomputed
                seq.prompt_logits.clear()
                seq.prompt_logprobs.clear()
        for rid, rows in result.prompt_logits.items():
            self._sequences[rid].prompt_logits.append(rows)
        for rid, lps in result.prompt_logprobs.items():
            self._sequences[rid].prompt_logprobs.extend(lps)
        for rid, rows in result.sample_logits.items():  # the rows of the tokens kept
            self._sequences[rid].sample_logits.append(rows[: appended[rid]])

    def advance(
        self, output: SchedulerOutput, result: StepResult, finished_ids: set[str]
    ) -> None:
        """Gather what the step added to every tracked sequence it ran (`finished_ids`: the
        scheduler requests it finished), then finish the requests whose sequences all ended."""
        touched: dict[str, list[Progress]] = {}
        for entry in output.scheduled:
            seq = self._sequences.get(entry.request.request_id)
            if seq is None:
                continue
            finished_now = seq.request.request_id in finished_ids
            if finished_now or seq.request.num_output_tokens > seq.num_seen:
                touched.setdefault(seq.parent_id, []).append(
                    self._advance(seq, result, finished_now)
                )
        now = time.time()
        for parent_id, steps in touched.items():
            parent = self._parents[parent_id]
            if any(step.token_ids for step in steps):
                parent.first_token_time = parent.first_token_time or now
                parent.last_token_time = now
            if parent.done:
                self._finish(parent, steps)
            elif self._reports_progress(parent):
                self._outputs.append(progress_output(parent, steps, self._tokenizer_of()))

    def _reports_progress(self, parent: ParentRequest) -> bool:
        """Whether `step()` returns the request's outputs before it finishes."""
        streamed = parent.request_id in self._stream_queues
        return not streamed and parent.output_kind != RequestOutputKind.FINAL_ONLY

    def _advance(
        self, seq: SequenceState, result: StepResult, finished_now: bool
    ) -> Progress:
        """Gather a sequence's new tokens: log-probabilities, finish, text and stop strings, and
        its stream's delta."""
        request = seq.request
        new = request.output_token_ids[seq.num_seen :]
        seq.num_seen = request.num_output_tokens
        kept = result.logprobs.get(request.request_id, [])[: len(new)]
        new_logprobs = gather_logprobs(seq, kept, self._tokenizer_of())
        if finished_now:
            seq.finish_reason = FINISH_REASONS[request.status]
            seq.stop_reason = request.stop_reason
        if seq.incremental:
            self._read_text(seq, new, finished_now)
        self._stream(seq, new, new_logprobs)
        return Progress(seq, new, new_logprobs)

    def _read_text(self, seq: SequenceState, new: list[int], finished_now: bool) -> None:
        """Add new tokens to the text (a token that stopped the sequence stays out of it); a
        stop string found there stops the sequence."""
        state, request = seq.text, seq.request
        if state is None:
            return
        by_token = finished_now and request.status == RequestStatus.FINISHED_STOPPED
        by_token = by_token and not state.include_stop
        state.add(new[:-1] if by_token else new, request.num_output_tokens, final=finished_now)
        if state.stop_string is None or seq.finish_reason == "abort":
            return
        if not finished_now:
            self._scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
        request.stop_reason = seq.stop_reason = state.stop_string
        seq.finish_reason = "stop"  # also when a length cap ended it in the same step, as vLLM

    def _stream(self, seq: SequenceState, new: list[int], logprobs: SampleLogprobs | None) -> None:
        queue = self._stream_queues.get(seq.parent_id)
        if queue is None:
            return
        finished = seq.finish_reason is not None
        text = None if seq.text is None else seq.text.delta(finished)
        queue.append(
            StreamDelta(
                seq.parent_id, seq.index, new, text, logprobs, seq.finish_reason, seq.stop_reason
            )
        )

    def _finish(self, parent: ParentRequest, steps: list[Progress]) -> None:
        """Forget a finished request; its output goes to `step()` (a stream had its deltas):
        every completion (FINAL_ONLY), or those its last step advanced (`steps`)."""
        del self._parents[parent.request_id]
        for seq in parent.sequences:
            self._sequences.pop(seq.request.request_id, None)
        if parent.request_id in self._stream_queues:
            return
        if parent.output_kind == RequestOutputKind.FINAL_ONLY:
            self._outputs.append(request_output(parent, self._tokenizer_of()))
        else:
            self._outputs.append(progress_output(parent, steps, self._tokenizer_of()))

    # ---- requests out --------------------------------------------------------------------------

    def abort(self, request_id: str) -> None:
        """End an unfinished request's running sequences with "abort" (in the scheduler too) and
        finish it; an id that is not an unfinished request's is ignored, as vLLM does (it may
        have finished in the meantime)."""
        parent = self._parents.get(request_id)
        if parent is None:
            return
        steps = []
        for seq in parent.sequences:
            if seq.finish_reason is None:
                self._scheduler.abort_request(seq.request.request_id)
                seq.finish_reason = "abort"
                if seq.incremental:
                    self._read_text(seq, [], finished_now=True)
                self._stream(seq, [], [] if seq.logprobs is not None else None)
                steps.append(Progress(seq, [], [] if seq.logprobs is not None else None))
        self._finish(parent, steps)

    def num_unfinished_sequences(self) -> int:
        """Completions still to finish (vLLM counts each of a request's `n`)."""
        return sum(
            seq.finish_reason is None for p in self._parents.values() for seq in p.sequences
        )

    def take_all(self) -> list[RequestOutput]:
        """Hand out every finished request's output, in the order they finished."""
        outputs, self._outputs = self._outputs, []
        return outputs

    def take(self, wanted: set[str], done: dict[str, RequestOutput]) -> None:
        """Move the outputs of the `wanted` requests into `done` (by request id); the others
        stay."""
        keep = []
        for out in self._outputs:
            if out.request_id in wanted:
                done[out.request_id] = out
            else:
                keep.append(out)
        self._outputs = keep

    def drop(self, request_ids: set[str]) -> None:
        """Abort requests whose caller is gone (an interrupted `generate`, a closed stream);
        their outputs go nowhere."""
        for request_id in request_ids:
            parent = self._parents.pop(request_id, None)
            for seq in parent.sequences if parent else ():
                self._scheduler.abort_request(seq.request.request_id)
                self._sequences.pop(seq.request.request_id, None)
        self._outputs = [o for o in self._outputs if o.request_id not in request_ids]

    def end_stream(self, request_ids: Iterable[str]) -> None:
        """A stream of these requests is closed: drop the unfinished ones, forget its queue."""
        ids = list(request_ids)
        self.drop({i for i in ids if i in self._parents})
        for request_id in ids:
            self._stream_queues.pop(request_id, None)
