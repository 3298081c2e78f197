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

Steps overlap only when every request only samples: no log-probabilities, prompt or sample
logits, penalties, `min_tokens`, bad words, allowed tokens or logit bias (their processing reads
the output tokens on the host), no speculative decoding (drafts are proposed from the tokens)
and one device (tensor-parallel ranks other than 0 do not sample). Otherwise the step in flight
is finished first and the step runs plainly.
"""

from __future__ import annotations

import time
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
    """`EngineConfig.async_scheduling`, where None means on for CUDA devices (where the host
    and the device run apart) and off elsewhere."""
    if config.async_scheduling is None:
        return device.type == "cuda"
    return config.async_scheduling


def overlappable(request: Request) -> bool:
    """Whether a request's steps may be scheduled before its previous token reaches the host
    (its sampling reads nothing of its output on the host)."""
    params = request.sampling_params
    return not (
        params.logprobs is not None
        or params.needs_prompt_rows
        or params.return_logits
        or params.has_penalties
        or params.changes_logits
        or params.min_tokens > 0
        or request.bad_words_token_ids
    )


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
            and e._tp is None
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
            process_step(e, output, e._execute(output), start)
            return
        if self.pending is None:
            self.pending = self._launch()
        in_flight, self.pending = self.pending, self._launch()
        process_step(e, in_flight.output, in_flight.result(), start)

    def finish_pending(self, start: float | None = None) -> None:
        """Wait for the step in flight and process its outputs (nothing when none is)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            start = time.perf_counter() if start is None else start
            process_step(self.engine, pending.output, pending.result(), start)

    def _launch(self) -> PendingStep:
        scheduler = self.engine.scheduler
        output = scheduler.schedule()
        pending = self.engine.runner.launch(output)
        scheduler.mark_in_flight(output)
        return pending


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
