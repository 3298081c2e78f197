"""The engine's step loop, with host work overlapped on the device's (vLLM's async scheduling,
SGLang's overlap scheduler).

A plain step schedules, runs the model, waits for the sampled ids and processes them, while the
device idles during the host's parts. An overlapped step instead keeps one step in flight:

    schedule N+1 -> launch N+1 (queued behind N) -> wait for N's ids -> process N's outputs

so scheduling, input preparation and output processing of one step run while the device
computes the previous one. Step N+1 is scheduled before N's tokens are known: the scheduler
counts each request N samples as having one more token (`Scheduler.mark_in_flight`), and the
runner takes that token's id from N's sampled ids on the device (`ModelRunner.launch`). Each
`step()` still returns the outputs of one step (the one it waited for).

Exactness: a request that N finishes (EOS, stop token, stop string) or that is aborted was
scheduled once more in N+1; that token is dropped. `max_tokens` and `max_model_len` are known
ahead, so no step is scheduled past them. A request preempted while its token is in flight keeps
the token. Greedy tokens are the same with and without overlap.

Steps overlap unless a request asks for prompt log-probabilities or prompt or sample logits
(read on the host from each step's rows) or the engine decodes speculatively (drafts are
proposed from the tokens); then the step in flight is finished first and the step runs plainly.
Sample log-probabilities are computed on the device and copied back with the ids
(`Sampler.step_logprobs`, `PendingStep`; vLLM 0.33's `AsyncGPUModelRunnerOutput` copies its
log-probability tensors the same way). Penalties, bad words and `min_tokens` read a request's
output tokens: an overlapped step samples them with the token still in flight appended, read
from the previous step's host copy once its forward is queued
(`runner/overlap.with_tokens_in_flight`, as vLLM 0.33's async scheduling fills its placeholders
in `update_async_output_token_ids` before sampling); logit bias and allowed tokens read nothing
of the outputs.

Tensor parallelism: rank 0 tells the other ranks, in each step's message, whether it launched
the step (`StepMessage.launch`); if so they launch it too (`tp_group.run_step`), and every rank
samples the same ids on its own device: the logits are all-gathered, so they are the same on
every rank, and so are the random numbers, because every rank's generators (the default one,
seeded from the engine's seed, and each seeded request's) draw in step with rank 0's. For that,
in plain steps, where rank 0 alone uses its tokens, the other ranks still make rank 0's random
draws (`overlap.draw_along`: the same `Sampler.sample_ids` call on the same logits and request
parameters, its ids left on the device unread); steps whose rows are all greedy draw nothing and
are skipped. This is exact whatever order plain and overlapped steps come in, for the price of
sampling on every rank in plain steps that sample randomly (a few batched device ops, no host
sync). The alternatives were worse: overlapping only while no request samples randomly would
not suffice (a seeded request's generator advances in plain steps too, so only engines that
never sampled randomly could overlap), and sending rank 0's generator states when steps start
to overlap would put device-specific state in the message. (Steps verifying drafts are not
replayed: an engine with speculative decoding never overlaps.) Each rank feeds its ids to its
next step from its own device; the `PendingStep` of ranks other than 0 is dropped (no copy to
the host), and they drop the state of finished requests as rank 0 does. A failure on any rank
(a launch, a collective, the wait for the ids) stops every rank, as in plain steps.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from unified_attn.request import Request
from unified_attn.runner.overlap import PendingStep
from unified_attn.runner.scheduler import SchedulerOutput
from unified_attn.runner.step_inputs import StepResult
from unified_attn.spec_decode.proposers import propose_drafts

if TYPE_CHECKING:
    from unified_attn.engine.engine_config import EngineConfig
    from unified_attn.engine.llm_engine import LLMEngine


def overlap_steps(config: EngineConfig, device: torch.device) -> bool:
    """`EngineConfig.async_scheduling`, where None means on for a CUDA device (where the host and
    the device run apart) and off elsewhere. With tensor parallelism None means off for now:
    overlapped TP steps are tested on the CPU (gloo) but have not run on GPUs yet
    (`tests/gpu/test_tensor_parallel_gpu.py`); `async_scheduling=True` turns them on."""
    if config.async_scheduling is None:
        return device.type == "cuda" and config.tensor_parallel_size == 1
    return config.async_scheduling


def overlappable(request: Request) -> bool:
    """Whether a request's steps may be scheduled before its previous token reaches the host:
    all but those asking for prompt log-probabilities or logits (see the module docstring)."""
    params = request.sampling_params
    return not (params.needs_prompt_rows or params.return_logits)


class StepLoop:
    """Runs the engine's steps, overlapped when `enabled` and the requests allow
    (`overlappable`); `pending` is the step in flight."""

    def __init__(self, engine: LLMEngine, enabled: bool) -> None:
        self.engine = engine
        self.enabled = enabled
        self.pending: PendingStep | None = None

    def may_overlap(self) -> bool:
        e = self.engine
        return (
            self.enabled
            and e.drafter is None
            and all(overlappable(r) for r in e.scheduler.requests.values())
        )

    def step(self) -> None:
        """One step's outputs (see the module docstring)."""
        e = self.engine
        start = time.perf_counter()
        if not self.may_overlap():
            if self.pending is not None:  # finish the step in flight, then run plainly
                self.finish_pending(start)
                return
            output = e.scheduler.schedule()
            process_step(e, output, self._execute(output), start)
            return
        if self.pending is None:
            self.pending = self._launch()
        in_flight, self.pending = self.pending, self._launch()
        process_step(e, in_flight.output, self._result(in_flight), start)

    def finish_pending(self, start: float | None = None) -> None:
        """Wait for the step in flight and process its outputs (nothing when none is)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            start = time.perf_counter() if start is None else start
            process_step(self.engine, pending.output, self._result(pending), start)

    def _execute(self, output: SchedulerOutput) -> StepResult:
        """A plain step, on every rank."""
        with self._failures():
            self._send(output, launch=False)
            return self.engine.runner.execute(output)

    def _launch(self) -> PendingStep:
        """Schedule and launch a step, on every rank."""
        e = self.engine
        output = e.scheduler.schedule()
        with self._failures():
            self._send(output, launch=True)
            pending = e.runner.launch(output)
        e.scheduler.mark_in_flight(output)
        return pending

    def _result(self, pending: PendingStep) -> StepResult:
        with self._failures():  # the wait on the device is where a broken collective shows
            return pending.result()

    def _send(self, output: SchedulerOutput, launch: bool) -> None:
        """With tensor parallelism: the step to the other ranks, which run it as this one does."""
        if self.engine._tp is not None:
            self.engine._tp.broadcast(output, launch)

    @contextlib.contextmanager
    def _failures(self) -> Iterator[None]:
        """With tensor parallelism, a failure (this rank's, or a collective that another rank's
        failure broke) stops every rank: `TensorParallelGroup.fail` raises a `RuntimeError`
        naming the rank that failed. The step in flight is dropped: it will never arrive."""
        try:
            yield
        except Exception as error:
            tp = self.engine._tp
            if tp is None:
                raise
            self.pending = None
            tp.fail(error)
            raise


def process_step(
    engine: LLMEngine, output: SchedulerOutput, result: StepResult, start: float
) -> None:
    """A step's sampled tokens into its requests (`update_from_output`), the stats, the next
    drafts, the outputs and the KV-cache events."""
    before = {e.request.request_id: e.request.num_output_tokens for e in output.scheduled}
    finished = engine.scheduler.update_from_output(output, result.sampled)
    appended = {
        e.request.request_id: e.request.num_output_tokens - before[e.request.request_id]
        for e in output.scheduled
    }
    engine.stats.record_step(output, result, appended, time.perf_counter() - start)
    engine._requests.keep_logits(output, result, appended)
    if engine.drafter is not None:
        propose_drafts(engine.drafter, output, engine.max_model_len)
    engine._requests.advance(output, result, {r.request_id for r in finished})
    engine._publish_kv_events()
