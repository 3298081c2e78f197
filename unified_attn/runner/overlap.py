"""What an overlapped step leaves behind (`ModelRunner.launch`, driven by `engine/step_loop.py`):
the sampled ids on the device, which the next step reads as input without a host round trip
(`DeviceTokens`), and the step's pending result, whose ids are copied to pinned host memory
behind the forward and read once the copy is done (`PendingStep`). Also the asynchronous host
to device copy every step input goes through (`pinned_to`): a copy from pageable memory makes
the host wait for the device, which would serialise the host's next step with this one
(`runner/device.pinned_to`). The requests whose sampling reads their output tokens
(penalties, bad words, `min_tokens`: `logits_processing.reads_outputs`) get the token the step
in flight sampled for them before the next step samples (`with_tokens_in_flight`, as vLLM's
`update_async_output_token_ids`). And the random draws a tensor-parallel rank other than 0 makes
in plain steps (`draw_along`), which keep its generators in step with rank 0's for the
overlapped steps every rank samples."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from unified_attn.request import Request
from unified_attn.runner.device import pinned_to
from unified_attn.runner.logprobs import StepLogprobs
from unified_attn.runner.sampler import ExtendedRequest, Sampler
from unified_attn.runner.scheduler import SchedulerOutput
from unified_attn.runner.step_inputs import StepResult


@attrs.frozen
class HostCopy:
    """Device tensors on their way to pinned host memory, and the event that marks them there
    (None on the CPU, where the copy is done at once)."""

    tensors: tuple[torch.Tensor, ...]
    event: torch.cuda.Event | None

    @staticmethod
    def start(*tensors: torch.Tensor) -> HostCopy:
        """Start copying `tensors` to the host, behind the work queued so far."""
        if tensors[0].device.type != "cuda":
            return HostCopy(tuple(t.clone() for t in tensors), None)
        hosts = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors)
        for host, t in zip(hosts, tensors, strict=True):
            host.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return HostCopy(hosts, event)

    def wait(self) -> tuple[torch.Tensor, ...]:
        """The host tensors, once copied (waits for this copy only, not for later work)."""
        if self.event is not None:
            self.event.synchronize()
        return self.tensors


@attrs.frozen
class DeviceTokens:
    """The ids sampled by the last launched step, on the device, each request's row, and the
    ids' copy to the host if the step started one."""

    ids: torch.Tensor  # [N] int64
    rows: dict[str, int]
    host: HostCopy | None = None  # the ids first, then the step's log-probability tensors

    @staticmethod
    def of_step(
        ids: torch.Tensor,
        requests: Sequence[Request],
        to_host: bool,
        readers: bool,
        logprobs: StepLogprobs | None = None,
    ) -> DeviceTokens:
        """A launched step's ids `[N]` (row i: `requests[i]`), copied to the host with its
        `logprobs`' tensors when `to_host`, or alone when `readers` (some request reads its
        outputs: the next step's sampling needs its token)."""
        host = None
        if to_host or readers:
            host = HostCopy.start(ids, *(logprobs.tensors if to_host and logprobs else ()))
        return DeviceTokens(ids, {r.request_id: j for j, r in enumerate(requests)}, host)

    def on_host(self) -> dict[str, int]:
        """Each request's id on the host: waits for their copy only, not for the steps launched
        after."""
        if self.host is None:
            raise RuntimeError("the last launched step did not copy its ids to the host")
        tokens: list[int] = self.host.wait()[0].tolist()
        return {rid: tokens[row] for rid, row in self.rows.items()}

    @staticmethod
    def none() -> DeviceTokens:
        """No ids: what a runner holds before its first launch and after a plain step."""
        return _NO_TOKENS

    def gather(self, request_ids: list[str]) -> torch.Tensor:
        """The ids of `request_ids` (device, no synchronisation); a request this step did not
        sample is a bug of the caller, refused with its id."""
        missing = [rid for rid in request_ids if rid not in self.rows]
        if missing:
            raise RuntimeError(
                f"requests {missing} wait for a token the last launched step did not sample; "
                "an overlapped step must follow the step that sampled its placeholders"
            )
        index = torch.tensor([self.rows[rid] for rid in request_ids], dtype=torch.int64)
        return self.ids.index_select(0, pinned_to(index, self.ids.device))


_NO_TOKENS = DeviceTokens(torch.zeros(0, dtype=torch.int64), {})


def with_tokens_in_flight(
    requests: Sequence[Request], readers: Sequence[Request], tokens: DeviceTokens
) -> Sequence[Request | ExtendedRequest]:
    """`requests`, each of `readers` (those whose sampling reads their outputs,
    `reads_outputs`) that has a token in flight (sampled by the last launched step, `tokens`,
    not yet in its `output_token_ids`) seen with that token appended: their penalties, bad
    words and `min_tokens` then read what a plain step would. Waits for the last step's ids
    only when such a request is in the batch (this step's forward is already queued)."""
    waiting = {r.request_id: r for r in readers if r.num_output_placeholders}
    if not waiting:
        return requests
    in_flight = tokens.on_host()
    for rid, r in waiting.items():
        if r.num_output_placeholders != 1 or rid not in in_flight:
            raise RuntimeError(
                f"request {rid!r} has {r.num_output_placeholders} tokens in flight, "
                "expected 1 sampled by the last launched step"
            )
    return [
        ExtendedRequest(r, [*r.output_token_ids, in_flight[r.request_id]])
        if r.request_id in waiting
        else r
        for r in requests
    ]


def draw_along(sampler: Sampler, output: SchedulerOutput, logits: torch.Tensor) -> None:
    """A tensor-parallel rank other than 0, in a plain step (`ModelRunner.execute(sample=False)`):
    make the random draws rank 0's sampling makes, so that every rank's generators (the
    default one and each seeded request's) stay in step with rank 0's, and an overlapped step,
    which every rank samples (`launch`), draws the same tokens everywhere.

    It is rank 0's own call (`Sampler.sample_ids`) on the same logits (all-gathered: the same on
    every rank) and the same requests' parameters; the ids stay on the device, unread. Greedy
    steps draw nothing and skip it. A step verifying drafts is skipped too: an engine with
    speculative decoding never overlaps, so its ranks never need the generators."""
    requests = [s.request for s in output.scheduled if s.will_sample]
    if len(requests) == len(logits) and not all(r.sampling_params.greedy for r in requests):
        sampler.sample_ids(logits, requests)


@attrs.define
class PendingStep:
    """A launched step: its scheduler output, and its sampled ids (and the log-probabilities
    its rows ask for) on their way to the host."""

    output: SchedulerOutput
    request_ids: list[str] = attrs.Factory(list)  # the sampled rows' requests, in order
    copy: HostCopy | None = None
    logprobs: StepLogprobs | None = None

    def result(self) -> StepResult:
        """Wait for the step's copy (only for it: later launched steps keep running) and
        return its `StepResult`."""
        result = StepResult()
        if self.copy is None:
            return result
        ids, *values = self.copy.wait()
        tokens: list[int] = ids.tolist()
        result.sampled = {rid: [token] for rid, token in zip(self.request_ids, tokens, strict=True)}
        if self.logprobs is not None:
            found = self.logprobs.assemble(values, tokens)
            for row, lp in zip(self.logprobs.rows, found, strict=True):
                result.logprobs[self.request_ids[row]] = [lp]
        return result
