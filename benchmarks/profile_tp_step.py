"""Where a decode step's time goes, one device against tensor parallelism (CUDA).

    python benchmarks/profile_tp_step.py [--size 2] [--batch 64]

Runs `bench-llama-1b` (bf16, Triton, CUDA graphs) at batch `--batch`, TP=1 then TP=`--size`,
and times rank 0's phases of every decode step with wall clocks around the engine's calls:
scheduling, the step broadcast (TP only), input preparation, the graph replay (launch only),
sampling (it waits for the device) and the rest (output bookkeeping). Prints the mean per
step of each phase; the device's own time per step is measured separately by replaying the
captured graph of that batch size alone.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections import defaultdict
from typing import Any

import torch
from common import time_method
from speculative import BENCH_MODEL, register_bench_model

from unified_attn import LLMEngine, SamplingParams

register_bench_model()  # at import: spawned ranks import this module again


def graph_device_time(engine: LLMEngine, batch: int) -> float:
    """Seconds per replay of the captured decode graph for `batch` requests, device-bound
    (100 replays back to back)."""
    graphs = engine.runner.graphs
    assert graphs is not None
    size = graphs.bucket(batch)
    graph = graphs.graphs[(size, 1)] if hasattr(graphs, "graphs") else None
    if graph is None:
        return float("nan")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(100):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / 100


def profile(size: int, batch: int, steps: int) -> dict[str, Any]:
    engine = LLMEngine(BENCH_MODEL, device="cuda", tensor_parallel_size=size, max_num_seqs=batch,
                       max_model_len=2048, max_num_batched_tokens=8192,
                       kv_cache_memory=None, gpu_memory_utilization=0.5)  # fmt: skip
    try:
        prompts = [[1 + (i * 7 + j) % 30000 for j in range(128)] for i in range(batch)]
        params = SamplingParams(max_tokens=steps, ignore_eos=True)
        engine.generate(prompts, params)  # warm-up
        totals: dict[str, float] = defaultdict(float)

        def add(label: str, seconds: float) -> None:
            totals[label] += seconds

        time_method(engine.scheduler, "schedule", functools.partial(add, "schedule"))
        if engine._tp is not None:
            time_method(engine._tp, "broadcast", functools.partial(add, "broadcast"))
        time_method(engine.runner, "prepare_inputs", functools.partial(add, "prepare_inputs"))
        waits = "sample (waits for the device)"
        time_method(engine.runner, "_sample", functools.partial(add, waits))
        if engine.runner.graphs is not None:
            time_method(engine.runner.graphs, "run", functools.partial(add, "graph launch"))
        time_method(engine, "_step", functools.partial(add, "step"))
        engine.generate([[p[0] + 1, *p[1:]] for p in prompts], params)
        steps_run = engine.stats.steps
        device_s = graph_device_time(engine, batch) if size == 1 else float("nan")
        return {"steps": steps_run, "totals": dict(totals), "graph_device_s": device_s}
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    for size in (1, args.size):
        report = profile(size, args.batch, args.steps)
        totals = report["totals"]
        decode_steps = args.steps  # the timed generate: 1 prefill step + (steps - 1) decodes
        print(f"TP={size} batch {args.batch}: {decode_steps} steps timed; per step (ms):")
        for label, seconds in totals.items():
            print(f"  {label:32s} {1e3 * seconds / decode_steps:7.3f}")
        if size == 1:
            print(f"  graph replay alone (device)      {1e3 * report['graph_device_s']:7.3f}")


if __name__ == "__main__":
    main()
