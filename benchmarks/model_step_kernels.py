"""Where a decode step's device time goes, kernel by kernel (CUDA).

    python benchmarks/model_step_kernels.py [--model llama-3-8b] [--batches 1,64,256]
        [--max-model-len N] [--out DIR]

Builds the engine as `model_step.py` does (a named shape with random weights, bf16, the Triton
backend, CUDA graphs, TP=1), brings B requests of 128-token prompts to decode, and replays the
captured decode graph of B: timed alone (CUDA events, `model_step_device.replay_ms`), then once
under `torch.profiler`, whose per-kernel durations give, per kernel name, the calls per replay,
microseconds per call and per replay, and the kernel's group (GEMM, attention, norm, rotary,
activation, KV write, other). The roofline of the step (`model_step_shapes`: the bytes one rank
reads at the device-to-device copy bandwidth measured in the same run, or the FLOPs at the
measured matmul rate) sits beside the replay, so the table shows which kernels hold the gap.
Then `--engine-steps` overlapped engine steps (the engine's own loop, host work included) run
under the profiler: per step, the span of the device's work, the time some kernel or copy ran
(the union of their intervals), the idle rest, and the kernels the graph does not hold (input
staging, sampling, copies): what the wall step adds to the replay.
Writes `model_step_kernels.json` and `.png` (the replay split by group per batch).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from common import (
    add_out_argument,
    csv_ints,
    make_console,
    pyplot,
    run_header,
    save_figure,
    save_run,
    table,
)
from model_step_device import probe, replay_ms
from model_step_shapes import (
    attention_shape,
    decode_cost,
    rank_weights,
    register_shapes,
    roofline_s,
)

from unified_attn.models.presets import get_preset

SCHEMA = "unified_attn.benchmarks.model_step_kernels/v1"
GROUPS = [  # (group, pattern of kernel names), first match wins
    ("GEMM", r"nvjet|gemm|cutlass|splitKreduce|sm90_xmma|cublas"),
    ("attention", r"unified_attention|merge_segments"),
    ("norm", r"rms_norm|layer_norm"),
    ("rotary", r"rotary"),
    ("activation", r"act_and_mul|silu|gelu"),
    ("KV write", r"write_kv|reshape_and_cache"),
]


def group_of(name: str) -> str:
    return next((g for g, pattern in GROUPS if re.search(pattern, name)), "other")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--batches", type=csv_ints, default=[1, 64, 256])
    parser.add_argument("--max-model-len", type=int, default=8208,
                        help="the engine's (model_step.py's with 8k prefills: 8208)")  # fmt: skip
    parser.add_argument("--engine-steps", type=int, default=16,
                        help="overlapped engine steps profiled per batch (0: none)")  # fmt: skip
    add_out_argument(parser)
    args = parser.parse_args(argv)
    if args.engine_steps < 0:
        parser.error(f"--engine-steps: 0 or more, got {args.engine_steps}")
    return args


def kernels_of_one_replay(graphs: Any, batch: int) -> list[tuple[str, float]]:
    """(name, us) of every kernel of one replay of the decode graph of `batch`."""
    from torch.profiler import ProfilerActivity, profile

    replay_ms(graphs, batch, 3)  # warm
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graphs.graphs[graphs.bucket(batch), 1].replay()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [(e.name, e.time_range.end - e.time_range.start) for e in events]


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of `(start, end)` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def profile_engine_steps(step: Any, steps: int, graph_kernels: set[str]) -> dict[str, Any]:
    """`steps` calls of `step` (overlapped engine steps) under the profiler: per step the span
    of the device's work, its busy and idle time, and the kernels outside the decode graph."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA]  # fmt: skip
    return step_timeline(events, steps, graph_kernels)


def step_timeline(
    events: list[tuple[float, float, str]], steps: int, graph_kernels: set[str]
) -> dict[str, Any]:
    """Per step: `span_us` (first start to last end over `steps`), `busy_us`, `idle_us`, and
    `outside_graph` (`breakdown` of the events whose name no graph kernel has, per step)."""
    if not events:
        return {"steps": steps, "span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0,
                "outside_graph": []}  # fmt: skip
    span = max(end for _, end, _ in events) - min(start for start, _, _ in events)
    busy = busy_us([(start, end) for start, end, _ in events])
    outside = breakdown([(name, end - start) for start, end, name in events
                         if name not in graph_kernels])  # fmt: skip
    for row in outside:  # per step
        row["calls"] /= steps
        row["us"] /= steps
    return {"steps": steps, "span_us": span / steps, "busy_us": busy / steps,
            "idle_us": (span - busy) / steps, "outside_graph": outside}  # fmt: skip


def breakdown(kernels: list[tuple[str, float]]) -> list[dict[str, Any]]:
    per_name: dict[str, list[float]] = defaultdict(list)
    for name, us in kernels:
        per_name[name].append(us)
    rows = [{"kernel": name, "group": group_of(name), "calls": len(times),
             "us_per_call": statistics.fmean(times), "us": sum(times)}
            for name, times in per_name.items()]  # fmt: skip
    return sorted(rows, key=lambda r: -r["us"])


def measure_batch(
    engine: Any, model: str, batch: int, ceilings: dict[str, float], engine_steps: int
) -> dict[str, Any]:
    from model_step_run import DecodeBatch, Settings

    settings = Settings(device="cuda", batches=(batch,), prompt_len=128, warmup=8, steps=0,
                        replays=0, prefill=(), prefill_reps=0, gpu_memory_utilization=0.85,
                        kv_cache_memory=None)  # fmt: skip
    requests = DecodeBatch(engine, settings, batch)
    try:
        requests.start()
        for _ in range(settings.warmup):
            requests.step()
        engine._loop.finish_pending()
        context = requests.mean_context()
        graphs = engine.runner.graphs
        replay = replay_ms(graphs, batch, 20) * 1e3
        kernels = breakdown(kernels_of_one_replay(graphs, batch))
        timeline = None
        if engine_steps:
            names = {k["kernel"] for k in kernels}
            timeline = profile_engine_steps(requests.step, engine_steps, names)
    finally:
        requests.stop()
    config = get_preset(model)
    attn = attention_shape(engine.kv_cache_report, config, 1)
    cost = decode_cost(rank_weights(engine.model, config), attn, batch, context)
    roofline = roofline_s(cost, ceilings["copy_bytes_per_s"], ceilings["matmul_flops_per_s"])
    groups: dict[str, float] = defaultdict(float)
    for row in kernels:
        groups[row["group"]] += row["us"]
    return {"batch": batch, "mean_context": context, "replay_us": replay,
            "kernels_us": sum(r["us"] for r in kernels), "roofline_us": roofline * 1e6,
            "groups_us": dict(groups), "kernels": kernels, "engine_steps": timeline}  # fmt: skip


def report(results: dict[str, Any], console: Any) -> None:
    for row in results["batches"]:
        t = table(f"batch {row['batch']}: replay {row['replay_us']:.0f} us, kernels "
                  f"{row['kernels_us']:.0f} us, roofline {row['roofline_us']:.0f} us",
                  ["kernel", "group", "calls", "us/call", "us", "share"])  # fmt: skip
        for k in row["kernels"][:14]:
            t.add_row(k["kernel"][:60], k["group"], str(k["calls"]), f"{k['us_per_call']:.2f}",
                      f"{k['us']:.0f}", f"{k['us'] / row['replay_us']:.1%}")  # fmt: skip
        console.print(t)
        line = row.get("engine_steps")
        if line:
            t = table(f"batch {row['batch']}: {line['steps']} overlapped engine steps, per step: "
                      f"device span {line['span_us']:.0f} us, busy {line['busy_us']:.0f}, idle "
                      f"{line['idle_us']:.0f}; kernels and copies outside the graph",
                      ["kernel", "calls", "us"])  # fmt: skip
            for k in line["outside_graph"][:10]:
                t.add_row(k["kernel"][:60], f"{k['calls']:.1f}", f"{k['us']:.1f}")
            console.print(t)


def plot(results: dict[str, Any], path: Any, console: Any) -> None:
    plt = pyplot(console)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [str(r["batch"]) for r in results["batches"]]
    bottom = [0.0] * len(labels)
    for group in [g for g, _ in GROUPS] + ["other"]:
        values = [r["groups_us"].get(group, 0.0) / 1e3 for r in results["batches"]]
        ax.bar(labels, values, bottom=bottom, label=group)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.scatter(labels, [r["replay_us"] / 1e3 for r in results["batches"]], color="black",
               marker="_", s=900, label="graph replay", zorder=3)  # fmt: skip
    ax.scatter(labels, [r["roofline_us"] / 1e3 for r in results["batches"]], color="red",
               marker="_", s=900, label="roofline", zorder=3)  # fmt: skip
    ax.set_xlabel("decode batch")
    ax.set_ylabel("ms per step")
    ax.set_title(f"{results['model']} decode step by kernel group (one GPU)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    save_figure(fig, path, 120)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/model_step_kernels.py needs a CUDA GPU", file=sys.stderr)
        raise SystemExit(2)
    console = make_console(140)
    register_shapes()
    from unified_attn import LLMEngine

    device = torch.device("cuda")
    ceilings = probe(device, torch.bfloat16)
    batches = args.batches
    engine = LLMEngine(args.model, device="cuda", max_num_seqs=max(batches),
                       max_model_len=args.max_model_len, max_num_batched_tokens=8192,
                       gpu_memory_utilization=0.85)  # fmt: skip
    try:
        rows = [measure_batch(engine, args.model, b, ceilings, args.engine_steps)
                for b in batches]  # fmt: skip
    finally:
        engine.shutdown()
    header = run_header(SCHEMA, "model_step_kernels.py", False, argv)
    results = {**header, "model": args.model, "max_model_len": args.max_model_len,
               "ceilings": ceilings, "batches": rows}  # fmt: skip
    save_run(args, "model_step_kernels", results, plot, report, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
