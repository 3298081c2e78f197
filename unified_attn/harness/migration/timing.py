"""Host time per decode step without running the model: `decode_engine` (requests already past
prefill), `decode_budget`, `time_decode_step`, `time_prep_forward` and the `host_time` summary
of the legacy and native engines."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from unified_attn.backend import AttentionBackend
from unified_attn.engine.llm_engine import LLMEngine
from unified_attn.sampling_params import RequestOutputKind, SamplingParams
from unified_attn.utils import cdiv


def decode_engine(
    backend: str | type[AttentionBackend],
    model: str,
    num_requests: int,
    context: int,
    **kwargs: Any,
) -> LLMEngine:
    """An engine whose `num_requests` requests are all past prefill, without running the model:
    only the scheduler and the runner's host side are driven. Give it `kv_cache_memory` for
    `num_requests * (context + steps)` tokens (see `decode_budget`)."""
    engine = LLMEngine(
        model,
        backend=backend,
        max_num_seqs=num_requests,
        max_num_batched_tokens=num_requests * context,
        enable_prefix_caching=False,
        **kwargs,
    )
    params = SamplingParams(
        max_tokens=engine.max_model_len - context,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    for i in range(num_requests):
        engine.add_request(None, [(i * 7919 + j) % 256 for j in range(context)], params)
    engine.runner.prepare_inputs(engine.scheduler.schedule())  # one prefill step: rows assigned
    return engine


def decode_budget(probe: LLMEngine, num_requests: int, tokens: int) -> int:
    """KV bytes for `num_requests` requests of `tokens` tokens in every group of `probe`'s model."""
    plan = probe.worker.plan
    blocks = num_requests * len(plan.groups) * (cdiv(tokens, plan.block_size) + 1) + 8
    return plan.bytes_per_block * blocks


def time_decode_step(engine: LLMEngine, token: int) -> tuple[float, float]:
    """One more decode step (every running request gets `token`): µs of
    `runner.prepare_inputs` and of the flat `prep_forward` loop. Scheduling is not timed, and
    engines in the same state see identical scheduler outputs."""
    runner, scheduler = engine.runner, engine.scheduler
    for request in scheduler.running:
        request.append_output_token_ids(token)
    output = scheduler.schedule()
    t0 = time.perf_counter_ns()
    inputs = runner.prepare_inputs(output)
    t1 = time.perf_counter_ns()
    for backend, gids in runner.backend_groups:
        backend.prep_forward(inputs.common, {gid: inputs.block_tables[gid] for gid in gids})
    if inputs.common.positions.is_cuda:
        torch.cuda.synchronize()
    t2 = time.perf_counter_ns()
    return (t1 - t0) / 1e3, (t2 - t1) / 1e3


def time_prep_forward(
    engines: dict[str, LLMEngine], steps: int, warmup: int = 3
) -> dict[str, dict[str, list[float]]]:
    """Per engine, µs per decode step of `prepare_inputs` and `prep_forward`; the engines take
    turns every step (in alternating order) so that drift on the machine hits them alike."""
    times: dict[str, dict[str, list[float]]] = {
        side: {"prepare_inputs": [], "prep_forward": []} for side in engines
    }
    sides = list(engines)
    for step in range(warmup + steps):
        for side in sides if step % 2 else sides[::-1]:
            prepare, prep = time_decode_step(engines[side], step % 256)
            if step >= warmup:
                times[side]["prepare_inputs"].append(prepare)
                times[side]["prep_forward"].append(prep)
    return times


def host_time(
    backends: dict[str, type[AttentionBackend]],
    model: str,
    probe: LLMEngine,
    num_requests: int = 64,
) -> dict[str, Any]:
    context, steps = 128, 20
    kwargs = {
        "device": probe.config.device,
        "dtype": probe.config.dtype,
        "max_model_len": 2 * context,
        "kv_cache_memory": decode_budget(probe, num_requests, context + steps + 4),
    }
    engines = {
        side: decode_engine(cls, model, num_requests, context, **kwargs)
        for side, cls in backends.items()
    }
    medians = {
        side: {key: statistics.median(values) for key, values in times.items()}
        for side, times in time_prep_forward(engines, steps).items()
    }
    return {
        "what": f"median µs per decode step ({num_requests} requests, {context}-token context) "
        "of runner.prepare_inputs and of the prep_forward loop; no model forward",
        **medians,
        "prep_forward_ratio": medians["legacy"]["prep_forward"] / medians["native"]["prep_forward"],
    }
