"""Host time of one decode step outside the model: scheduling, the runner's metadata build, and
the flat `prep_forward` loop over backend instances.

    python benchmarks/step_overhead.py [--quick] [--backend reference] [--device cpu]

For 64 / 256 / 512 running decode requests (1,000-token contexts, block size 16) and models
with 1 KV-cache group (4 full-attention layers) and 4 groups (full, sliding 128, sliding 512,
chunked 256), it times per step: `Scheduler.schedule()`, `ModelRunner.prepare_inputs()` (block
tables, slot mappings, `CommonAttentionMetadata`) and the `prep_forward` loop. The model forward
is not run; the cyclic garbage collector is paused while steps are timed. Writes
`<out>/step_overhead.json`.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Sequence

import attrs
import torch
from common import (
    add_out_argument,
    command_line,
    machine_info,
    output_dir,
    summary,
    table,
    write_json,
)
from rich.console import Console

from unified_attn.managers import KVCacheManager
from unified_attn.models import DecoderModel, LayerKind, get_preset
from unified_attn.request import Request
from unified_attn.runner.model_runner import ModelRunner
from unified_attn.runner.scheduler import Scheduler
from unified_attn.runner.worker import Worker
from unified_attn.sampling_params import SamplingParams
from unified_attn.selector import resolve_backend

CONTEXT = 1000
MAX_MODEL_LEN = 1088  # the context, the timed decode steps and a margin: a small KV buffer
LAYOUTS = {
    "1 group": (LayerKind.full(),) * 4,
    "4 groups": (
        LayerKind.full(),
        LayerKind.sliding(128),
        LayerKind.sliding(512),
        LayerKind.chunked(256),
    ),
}


def build(layout: str, num_requests: int, backend: str, device: str):
    config = attrs.evolve(get_preset("tiny-llama"), layer_kinds=LAYOUTS[layout])
    model = DecoderModel(config, resolve_backend(backend), device=device)
    worker = Worker(
        model, device=device, max_model_len=MAX_MODEL_LEN, max_in_flight_tokens=MAX_MODEL_LEN,
        kv_cache_memory=1,
    )  # fmt: skip
    num_blocks = num_requests * (sum(worker.blocks_per_request) + 1) + 1
    worker.allocate(num_blocks)
    kv = KVCacheManager(worker.plan.scheduler_config(num_blocks), MAX_MODEL_LEN)
    scheduler = Scheduler(
        kv, max_num_seqs=num_requests, max_num_batched_tokens=CONTEXT * num_requests,
        max_model_len=MAX_MODEL_LEN,
    )  # fmt: skip
    runner = ModelRunner(
        model, worker.plan, device=device, max_num_seqs=num_requests, max_model_len=MAX_MODEL_LEN
    )
    params = SamplingParams(max_tokens=MAX_MODEL_LEN - CONTEXT)
    for i in range(num_requests):
        tokens = [(i * 7919 + j) % 256 for j in range(CONTEXT)]
        scheduler.add_request(
            Request(f"r{i}", tokens, block_hasher=kv.make_block_hasher(), sampling_params=params)
        )
    prefill = scheduler.schedule()  # every prompt in one step
    runner.prepare_inputs(prefill)  # assigns block-table rows
    return scheduler, runner


def time_steps(scheduler: Scheduler, runner: ModelRunner, steps: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"schedule": [], "prepare_inputs": [], "prep_forward": []}
    for step in range(steps):
        for request in scheduler.running:
            request.append_output_token_ids(step % 256)
        t0 = time.perf_counter_ns()
        output = scheduler.schedule()
        t1 = time.perf_counter_ns()
        inputs = runner.prepare_inputs(output)
        common, tables = inputs.common, inputs.block_tables
        t2 = time.perf_counter_ns()
        for backend, gids in runner.backend_groups:
            backend.prep_forward(common, {gid: tables[gid] for gid in gids})
        if common.positions.is_cuda:
            torch.cuda.synchronize()
        t3 = time.perf_counter_ns()
        times["schedule"].append((t1 - t0) / 1e3)
        times["prepare_inputs"].append((t2 - t1) / 1e3)
        times["prep_forward"].append((t3 - t2) / 1e3)
    return times


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--backend", default="reference")
    parser.add_argument("--device", default="cpu")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    sizes = [8, 16] if args.quick else [64, 256, 512]
    steps, warmup = (3, 1) if args.quick else (32, 4)
    results = []
    for layout in LAYOUTS:
        for n in sizes:
            scheduler, runner = build(layout, n, args.backend, args.device)
            time_steps(scheduler, runner, warmup)
            gc.collect()
            gc.disable()  # a collection of the many request objects must not land in a step
            try:
                times = time_steps(scheduler, runner, steps)
            finally:
                gc.enable()
            del scheduler, runner  # the next model's KV buffer must not stack on this one
            row = {"layout": layout, "num_requests": n}
            row.update({k: summary(v) for k, v in times.items()})
            results.append(row)
    report = {
        "command": command_line("step_overhead.py", argv),
        "machine": machine_info(),
        "backend": args.backend,
        "device": args.device,
        "context_tokens": CONTEXT,
        "steps": steps,
        "results": results,
    }
    print_table(report)
    write_json(output_dir(args) / "step_overhead.json", report)
    return report


def print_table(report: dict) -> None:
    t = table(
        f"Decode step host time, µs (median), backend {report['backend']}",
        ("layout", "requests", "schedule", "prepare_inputs", "prep_forward", "total"),
    )
    for row in report["results"]:
        parts = [row[k]["median"] for k in ("schedule", "prepare_inputs", "prep_forward")]
        t.add_row(row["layout"], str(row["num_requests"]), *(f"{p:,.0f}" for p in parts),
                  f"{sum(parts):,.0f}")  # fmt: skip
    Console().print(t)


if __name__ == "__main__":
    main()
