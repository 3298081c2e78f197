"""Small builders shared by the scheduler, model-runner and engine tests: a `Scheduler` over a
real `KVCacheManager` (no model), requests with its block hasher, one-step drivers, and a
scripted sampler for an engine."""

from __future__ import annotations

from collections.abc import Iterable

from tests.managers.helpers import FULL, make_manager, make_request
from unified_attn.request import Request
from unified_attn.runner.sampler import SamplerOutput
from unified_attn.runner.scheduler import Scheduler, SchedulerOutput
from unified_attn.sampling_params import SamplingParams


def make_scheduler(
    num_blocks: int = 32,
    block_size: int = 4,
    groups=(FULL,),
    *,
    max_model_len: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    eos_token_ids: tuple[int, ...] = (),
    **manager_kwargs,
) -> Scheduler:
    kv = make_manager(num_blocks, block_size, groups, max_model_len=max_model_len, **manager_kwargs)
    return Scheduler(
        kv,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        eos_token_ids=eos_token_ids,
    )


def add(scheduler: Scheduler, request_id: str, tokens: Iterable[int], **params) -> Request:
    """Queue a request whose `SamplingParams` are built from `params`."""
    request = make_request(
        scheduler.kv, request_id, tokens, sampling_params=SamplingParams(**params)
    )
    scheduler.add_request(request)
    return request


def summary(output: SchedulerOutput) -> list[tuple[str, int, int]]:
    """(request id, tokens computed before the step, tokens scheduled) per scheduled request."""
    return [
        (s.request.request_id, s.num_computed_before, s.num_new_tokens) for s in output.scheduled
    ]


def sample_all(output: SchedulerOutput, token: int = 7) -> dict[str, int]:
    """`token` for every request of the step that samples."""
    return {s.request.request_id: token for s in output.scheduled if s.will_sample}


def run_step(scheduler: Scheduler, token: int = 7) -> SchedulerOutput:
    """Schedule one step and feed `token` back to every request that sampled."""
    output = scheduler.schedule()
    scheduler.update_from_output(output, sample_all(output, token))
    return output


def script(engine, tokens) -> None:
    """Make `engine` sample `tokens[i]` as the i-th output token of every request (the model
    still runs; only the choice is scripted), so that text rules can be tested on known text."""
    tokens = list(tokens.encode() if isinstance(tokens, str) else tokens)

    def sample(logits, requests):
        chosen = [tokens[r.num_output_tokens] for r in requests]
        return SamplerOutput(chosen, [None] * len(requests))

    engine.runner.sampler.sample = sample
