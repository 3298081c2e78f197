"""Continuous batching: FCFS, chunked prefill, prefix caching, preemption by recompute.

Each step first continues running requests (oldest first), preempting the most recently added
running request when the KV pool is full, then admits waiting requests while the token budget,
the sequence budget and the pool allow. A preempted request frees its blocks (its hashed blocks
stay cached), restarts from zero computed tokens and goes to the front of the waiting queue.

Overlapped steps (`engine/step_loop.py`): `schedule()` may run before the previous step's
tokens reach the host. Such a step (`mark_in_flight`) adds one output placeholder to each request
it samples (`Request.num_output_placeholders`), which the next schedule counts as a known token
(its id comes from the device); `update_from_output` replaces it with the token. A request whose
placeholders already reach `max_tokens` or `max_model_len` is not scheduled again; one that
stops on a token the host has not seen yet (EOS, a stop token or string) was scheduled once more,
and that step's token is dropped. A request preempted while a token is in flight keeps the token
(it was computed before its blocks were freed) and is not readmitted until it has arrived.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

import attrs

from unified_attn.managers import KVCacheManager
from unified_attn.request import Request, RequestStatus
from unified_attn.sampling_params import SamplingParams


@attrs.frozen
class ScheduledRequest:
    """One request's share of a step: tokens `[num_computed_before, num_computed_before +
    num_new_tokens)` of `request.all_token_ids`."""

    request: Request
    num_new_tokens: int
    num_computed_before: int  # tokens in the cache before this step
    # Full block tables for requests (re)starting this step, else only the new block ids.
    block_ids: tuple[list[int], ...]
    is_new: bool
    # This step reaches the end of the request's known tokens: its last row is sampled.
    # Fixed when scheduled (the request grows once the sampled token is appended).
    will_sample: bool
    # Speculative decoding: draft tokens scheduled after the request's last token (they are
    # part of `num_new_tokens`; every row from the last token on is verified).
    spec_token_ids: tuple[int, ...] = ()


@attrs.frozen
class SchedulerOutput:
    """What one step runs, in batch order, and what the runner may forget."""

    scheduled: list[ScheduledRequest]
    preempted: list[Request]
    # requests whose per-request state the runner may drop: finished, aborted or preempted
    finished_ids: list[str]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Decides, step by step, which requests run and how many tokens each computes.

    `schedule()` returns a `SchedulerOutput`; the engine runs it, then calls
    `update_from_output(output, sampled)` with the sampled tokens. The scheduler owns request
    state (status, `num_computed_tokens`, the waiting and running queues) and drives the
    `KVCacheManager`; it never touches tensors.
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        if max_num_seqs <= 0 or max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_seqs ({max_num_seqs}) and max_num_batched_tokens "
                f"({max_num_batched_tokens}) must be positive"
            )
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        # End prefill chunks on these boundaries so state groups leave prefix checkpoints.
        self.checkpoint_alignment = kv_cache_manager.checkpoint_alignment
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._dropped: list[str] = []
        self.num_preemptions = 0

    # ---- requests ------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request (FCFS). Refuses a duplicate id and a prompt with no room to generate
        within `max_model_len`; nothing changes when it refuses."""
        if request.request_id in self.requests:
            raise ValueError(
                f"request id {request.request_id!r} is already in use; pick another id or let "
                "the engine choose one"
            )
        if request.num_tokens >= self.max_model_len:
            raise ValueError(
                f"request {request.request_id}: {request.num_tokens} tokens leave no room to "
                f"generate within max_model_len={self.max_model_len}; shorten the prompt"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Stop a request wherever it is and free its blocks; unknown ids are ignored (the engine
        refuses them before they get here)."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request wherever it is with a finished `status` (the engine stops requests whose
        text reached a stop string) and free its blocks; unknown ids are ignored."""
        if not status.is_finished:
            raise ValueError(
                f"finish_request({request_id!r}): status must be a finished one, got {status}"
            )
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, status)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.kv.new_step_starts()
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.num_output_placeholders and self._reaches_its_end(request):
                i += 1  # its in-flight token finishes it: nothing more to compute
                continue
            num_new = self._num_new(request, request.num_computed_tokens, budget)
            drafts = self._drafts(request, num_new, budget)
            new_blocks = self.kv.allocate_slots(request, num_new, num_lookahead_tokens=len(drafts))
            while new_blocks is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
                new_blocks = self.kv.allocate_slots(
                    request, num_new, num_lookahead_tokens=len(drafts)
                )
            if new_blocks is None:
                break
            block_ids = new_blocks.get_block_ids()
            scheduled.append(self._commit(request, num_new, block_ids, False, drafts))
            budget -= num_new + len(drafts)
            i += 1
        if not preempted:
            budget = self._admit_waiting(scheduled, budget)
        dropped, self._dropped = self._dropped, []
        return SchedulerOutput(scheduled, preempted, dropped)

    def _admit_waiting(self, scheduled: list[ScheduledRequest], budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.num_output_placeholders:
                break  # preempted with a token in flight: readmit it once the token is known
            hits, num_hit = self.kv.get_computed_blocks(request)
            num_new = self._num_new(request, num_hit, budget)
            if self.kv.allocate_slots(request, num_new, num_hit, hits) is None:
                break  # the pool is full: wait for running requests to finish
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            block_ids = self.kv.get_block_ids(request)
            scheduled.append(self._commit(request, num_new, block_ids, True))
            budget -= num_new
        return budget

    def _num_new(self, request: Request, computed: int, budget: int) -> int:
        """Tokens to schedule. With state groups, a chunk that crosses a checkpoint boundary
        stops on the last one it crosses (a prompt's final chunk too), so a later request with
        the same prefix finds a cached state there."""
        known = request.num_tokens + request.num_output_placeholders  # placeholders: in flight
        end = computed + min(known - computed, budget)
        align = self.checkpoint_alignment
        if align and computed < end // align * align < end:
            end = end // align * align
        return end - computed

    def _drafts(self, request: Request, num_new: int, budget: int) -> tuple[int, ...]:
        """The request's draft tokens that this step verifies: only in decode (its one new
        token is its last), as many as the token budget and `max_model_len` leave room for.
        Taken from the request: a draft is verified once."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        known = request.num_tokens + request.num_output_placeholders
        if not drafts or request.num_computed_tokens + num_new != known:
            return ()
        room = min(budget - num_new, self.max_model_len - request.num_tokens)
        return tuple(drafts[: max(room, 0)])

    def _commit(
        self,
        request: Request,
        num_new: int,
        block_ids: tuple[list[int], ...],
        is_new: bool,
        drafts: tuple[int, ...] = (),
    ) -> ScheduledRequest:
        start = request.num_computed_tokens
        will_sample = start + num_new == request.num_tokens + request.num_output_placeholders
        entry = ScheduledRequest(
            request, num_new + len(drafts), start, block_ids, is_new, will_sample, drafts
        )
        request.num_computed_tokens += num_new + len(drafts)
        return entry

    def mark_in_flight(self, output: SchedulerOutput) -> None:
        """The step `output` was launched and the next `schedule()` comes before its tokens
        reach the host: each request it samples counts one output placeholder until
        `update_from_output`."""
        for entry in output.scheduled:
            entry.request.num_output_placeholders += entry.will_sample

    def _reaches_its_end(self, request: Request) -> bool:
        """Whether the tokens in flight (`num_output_placeholders`, some) already take
        `request` to `max_tokens` or `max_model_len`."""
        pending = request.num_output_placeholders
        max_tokens = request.sampling_params.max_tokens
        return (
            max_tokens is not None and request.num_output_tokens + pending >= max_tokens
        ) or request.num_tokens + pending >= self.max_model_len

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        self._dropped.append(request.request_id)

    # ---- after the step ------------------------------------------------------------------------

    def update_from_output(
        self, output: SchedulerOutput, sampled: Mapping[str, int | Sequence[int]]
    ) -> list[Request]:
        """Append sampled tokens (one per request, or with speculative decoding the accepted
        drafts and one more), apply stop conditions after each; returns requests finished this
        step. Rejected drafts are rolled back: their tokens are no longer computed."""
        finished = []
        for entry in output.scheduled:
            request = entry.request
            request.state_column = 0
            if not entry.will_sample:
                continue
            if request.num_output_placeholders:  # an overlapped step's token has arrived
                request.num_output_placeholders -= 1
            if request.status == RequestStatus.PREEMPTED:
                finished += self._deliver_to_preempted(request, sampled[request.request_id])
                continue
            if request.status != RequestStatus.RUNNING:
                continue  # finished (stop string, abort) while this step was in flight
            tokens = sampled[request.request_id]
            tokens = [tokens] if isinstance(tokens, int) else list(tokens)
            if entry.spec_token_ids:
                request.num_computed_tokens -= len(entry.spec_token_ids) - (len(tokens) - 1)
                # state layers left the state after each token: resume from the last kept
                request.state_column = len(tokens) - 1
            for token in tokens:
                request.append_output_token_ids(token)
                status = self._stop_status(request)
                if status is not None:
                    self.running.remove(request)
                    self._finish(request, status)
                    finished.append(request)
                    break
        return finished

    def _deliver_to_preempted(
        self, request: Request, tokens: int | Sequence[int]
    ) -> list[Request]:
        """A token sampled before its request was preempted (overlapped steps): it is part of
        the request, and it may finish it while it waits."""
        for token in [tokens] if isinstance(tokens, int) else tokens:
            request.append_output_token_ids(token)
            status = self._stop_status(request)
            if status is not None:
                self.waiting.remove(request)
                self._finish(request, status)
                return [request]
        return []

    def _stop_status(self, request: Request) -> RequestStatus | None:
        """vLLM 0.33's `check_stop` order: EOS (unless ignored), then `stop_token_ids` (the
        token becomes the `stop_reason`), and only then the length caps (`max_tokens`, and
        `max_model_len`). The model's first EOS id is its EOS; further EOS ids (a generation
        config's list) stop with their id as the `stop_reason`, as vLLM adds them to the stop
        tokens. `min_tokens` needs no check here: the sampler masks these tokens until then."""
        params: SamplingParams = request.sampling_params
        token = request.output_token_ids[-1]
        if not params.ignore_eos and token in self.eos_token_ids:
            if token != self.eos_token_ids[0]:
                request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        num_output = request.num_output_tokens
        if (
            params.max_tokens is not None and num_output >= params.max_tokens
        ) or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        del self.requests[request.request_id]
        self._dropped.append(request.request_id)
