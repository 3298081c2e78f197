"""Running the workload on one engine: `EngineRun` (outputs, step times, mixed steps),
`run_workload`, and the `coverage` of what the run exercised (`REQUIRED_COVERAGE`)."""

from __future__ import annotations

import time

import attrs

from unified_attn.engine.llm_engine import LLMEngine
from unified_attn.engine.outputs import RequestOutput
from unified_attn.harness.migration.migration_workload import Workload
from unified_attn.sampling_params import RequestOutputKind, SamplingParams

REQUIRED_COVERAGE = (
    "mixed_prefill_decode_steps",
    "chunked_prefills",
    "prefix_hit_tokens",
    "preemptions",
)


@attrs.define
class EngineRun:
    engine: LLMEngine
    outputs: list[RequestOutput]
    step_ms: list[float]
    mixed_steps: int
    peak_blocks: int  # the most KV blocks the requests held at once


def run_workload(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> EngineRun:
    params = SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=True,
        return_logits=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    ids = [engine.add_request(None, p, params) for p in prompts]
    done: dict[str, RequestOutput] = {}
    step_ms, mixed, stats = [], 0, engine.stats
    pool, peak = engine.kv_cache_manager.block_pool, 0
    while engine.has_unfinished_requests():
        before = (stats.prefill_tokens, stats.decode_tokens)
        start = time.perf_counter()
        finished = engine.step()
        step_ms.append(1e3 * (time.perf_counter() - start))
        mixed += stats.prefill_tokens > before[0] and stats.decode_tokens > before[1]
        peak = max(peak, pool.num_blocks - 1 - pool.get_num_free_blocks())
        done.update((out.request_id, out) for out in finished)
    return EngineRun(engine, [done[i] for i in ids], step_ms, mixed, peak)


def coverage(run: EngineRun, workload: Workload, prompts: list[list[int]]) -> dict[str, int]:
    layers = [layer for layer, _ in run.engine.model.attention_layers()]
    return {
        "mixed_prefill_decode_steps": run.mixed_steps,
        "chunked_prefills": sum(len(p) > workload.max_num_batched_tokens for p in prompts),
        "prefix_hit_tokens": run.engine.kv_cache_manager.prefix_cache_stats.hits,
        "preemptions": run.engine.scheduler.num_preemptions,
        "sliding_window_layers": sum(layer.sliding_window is not None for layer in layers),
        "chunked_local_layers": sum(layer.chunk_size is not None for layer in layers),
    }
