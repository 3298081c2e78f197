"""Host time the legacy adapter adds per decode step, against the native backend it ports.

    python benchmarks/adapter_overhead.py [--quick] [--device cpu[,cuda]] [--pairs reference,triton]

For 64 and 256 running decode requests (tiny-hybrid: 4 KV-cache groups over 3 backend
instances; 256-token contexts) it measures, adapter vs native:

- `prep_forward`: the runner's flat `prep_forward` loop on identical scheduler outputs (for the
  adapter: per-group legacy metadata + `builder.build`); for the adapter also its own share
  (its `prep_forward` minus the builders' `build` calls on the same inputs);
- `forward dispatch`: one layer's `forward` through the adapter minus the same call made
  directly on the legacy impl (shape checks, impl lookup, cache view, metadata lookup), on a
  4-request batch so that the math does not drown it;
- `engine step`: a whole `LLMEngine.step()` of tiny-llama in decode (model math included).

No step runs the attention math inside the timed `prep_forward` loop. Writes
`<out>/adapter_overhead.json`. The target is adapter <= 1.2x native for `prep_forward`.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

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

from unified_attn import LLMEngine, SamplingParams
from unified_attn.cli.arguments import prepare_cli
from unified_attn.harness.migration import (
    decode_budget,
    decode_engine,
    engine_backend_name,
    time_prep_forward,
)
from unified_attn.harness.migration.migration_run import legacy_name
from unified_attn.legacy_adapter.adapter import LegacyBackendAdapter, per_group_common
from unified_attn.sampling_params import RequestOutputKind
from unified_attn.selector import resolve_backend

MODEL = "tiny-hybrid"
CONTEXT = 256


def build_engines(native: str, num_requests: int, device: str, steps: int) -> dict[str, Any]:
    probe = LLMEngine(MODEL, backend=native, device=device, dtype="float32")
    kwargs = {
        "device": device,
        "dtype": "float32",
        "max_model_len": 2 * CONTEXT,
        "kv_cache_memory": decode_budget(probe, num_requests, CONTEXT + steps + 8),
        "cuda_graphs": False,
    }
    return {
        side: decode_engine(name, MODEL, num_requests, CONTEXT, **kwargs)
        for side, name in backend_names(native).items()
    }


def backend_names(native: str) -> dict[str, str]:
    """What `LLMEngine(backend=...)` takes for the native backend and for its legacy port."""
    adapter = engine_backend_name(resolve_backend(legacy_name(native)))
    return {"native": native, "adapter": adapter}


def time_builders(engine: LLMEngine, steps: int) -> dict[str, list[float]]:
    """µs per step, on the same inputs: every adapter builder's `build` alone, and the whole
    `prep_forward` loop (builds plus the adapter's per-group metadata and bookkeeping)."""
    runner, scheduler = engine.runner, engine.scheduler
    times: dict[str, list[float]] = {"builders": [], "prep_forward": []}
    for step in range(steps):
        for request in scheduler.running:
            request.append_output_token_ids(step % 256)
        inputs = runner.prepare_inputs(scheduler.schedule())
        common, tables = inputs.common, inputs.block_tables
        inputs = [
            (backend.builders[gid], per_group_common(common, gid, tables[gid]))
            for backend, gids in runner.backend_groups
            if isinstance(backend, LegacyBackendAdapter)
            for gid in gids
        ]
        start = time.perf_counter_ns()
        for builder, group_common in inputs:
            builder.build(0, group_common)
        middle = time.perf_counter_ns()
        for backend, gids in runner.backend_groups:
            backend.prep_forward(common, {gid: tables[gid] for gid in gids})
        end = time.perf_counter_ns()
        times["builders"].append((middle - start) / 1e3)
        times["prep_forward"].append((end - middle) / 1e3)
    return times


def time_calls(fns: dict[str, Callable[[], Any]], repeats: int, sync: bool) -> dict[str, float]:
    """Fastest µs of each call (the math is identical; the minimum filters scheduling noise
    that would hide a µs-scale difference), in a shuffled order per repeat."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    order, rng = list(fns), random.Random(0)
    for _ in range(repeats):
        rng.shuffle(order)  # no call always runs right after the same other one (warm caches)
        for name in order:
            fn = fns[name]
            start = time.perf_counter_ns()
            fn()
            if sync:
                torch.cuda.synchronize()
            samples[name].append((time.perf_counter_ns() - start) / 1e3)
    return {name: min(times) for name, times in samples.items()}


def forward_dispatch(engines: dict[str, Any], repeats: int) -> dict[str, float]:
    """One layer's forward: native, adapter, and the legacy impl called directly."""
    runner, scheduler = engines["adapter"].runner, engines["adapter"].scheduler
    for request in scheduler.running:
        request.append_output_token_ids(0)
    inputs = runner.prepare_inputs(scheduler.schedule())
    common, tables = inputs.common, inputs.block_tables
    t, device = common.num_actual_tokens, common.positions.device
    calls = {}
    for side, engine in engines.items():
        layer, backend = next(iter(engine.model.attention_layers()))
        gids = dict(engine.runner.backend_groups)[backend]
        backend.prep_forward(common, {gid: tables[gid] for gid in gids})
        d = layer.head_size
        q, k, v = (
            torch.randn(t, h * d, device=device)
            for h in (layer.num_heads, layer.num_kv_heads, layer.num_kv_heads)
        )
        out = torch.empty_like(q)
        calls[side] = functools.partial(backend.forward, layer, out, q, k, v)
        if isinstance(backend, LegacyBackendAdapter):
            calls[side]()  # creates the layer's impl
            bound = backend.impls[layer.name]
            md = backend.current_plan().metadata[backend.group_of_layer[layer.name]]
            q3, k3, v3, o3 = (x.view(t, -1, d) for x in (q, k, v, out))
            cache = backend.legacy_caches[layer.name]
            calls["legacy impl direct"] = functools.partial(
                bound.impl.forward, bound.legacy_layer, q3, k3, v3, cache, md, o3
            )
    result = time_calls(calls, repeats, device.type == "cuda")
    result["adapter dispatch"] = result["adapter"] - result["legacy impl direct"]
    return result


def engine_steps(native: str, num_requests: int, device: str, steps: int) -> dict[str, Any]:
    """ms per decode `LLMEngine.step()` of tiny-llama (model and attention math included); the
    two engines take turns every step."""
    engines = {}
    for side, name in backend_names(native).items():
        engine = LLMEngine("tiny-llama", backend=name, device=device, dtype="float32",
                           max_num_seqs=num_requests, max_num_batched_tokens=32 * num_requests,
                           cuda_graphs=False)  # fmt: skip
        params = SamplingParams(
            max_tokens=steps + 4, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
        )
        for i in range(num_requests):
            engine.add_request(None, [(i * 31 + j) % 256 for j in range(32)], params)
        for _ in range(3):  # the prefill, then warm-up decodes (kernel compilation)
            engine.step()
        engines[side] = engine
    times: dict[str, list[float]] = {side: [] for side in engines}
    for step in range(steps):
        for side in list(engines)[:: 1 if step % 2 else -1]:
            start = time.perf_counter()
            engines[side].step()
            times[side].append(1e3 * (time.perf_counter() - start))
    return {side: summary(values) for side, values in times.items()}


def measure(native: str, num_requests: int, device: str, steps: int) -> dict[str, Any]:
    engines = build_engines(native, num_requests, device, 3 * steps)
    prep = time_prep_forward(engines, steps)
    row: dict[str, Any] = {"backend": native, "num_requests": num_requests}
    for key in ("prepare_inputs", "prep_forward"):
        row[key] = {side: summary(times[key]) for side, times in prep.items()}
    split = time_builders(engines["adapter"], steps)
    row["adapter_split"] = {key: summary(times) for key, times in split.items()}
    # Dispatch is a per-call cost: measured on a 4-request batch, where the math is small.
    row["forward_us"] = forward_dispatch(build_engines(native, 4, device, 8), repeats=8 * steps)
    row["engine_step_ms"] = engine_steps(native, num_requests, device, max(4, steps // 2))
    medians = {side: row["prep_forward"][side]["median"] for side in ("adapter", "native")}
    row["prep_forward_ratio"] = medians["adapter"] / medians["native"]
    # The adapter's own share of its prep_forward (the rest is the legacy builders' work).
    row["adapter_own_us"] = statistics.median(
        total - builders
        for total, builders in zip(split["prep_forward"], split["builders"], strict=True)
    )
    return row


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cpu,cuda")
    parser.add_argument(
        "--pairs", default=None, help="native backends (default: reference; on CUDA also triton)"
    )
    parser.add_argument("--threads", type=int, default=1)
    add_out_argument(parser)
    args = parser.parse_args(argv)
    devices = args.device.split(",")
    prepare_cli(devices[0], args.threads)
    sizes, steps = ([8], 4) if args.quick else ([64, 256], 32)
    results = [
        {"device": device} | measure(native, n, device, steps)
        for device in devices
        for native in (args.pairs or default_pairs(device)).split(",")
        for n in sizes
    ]
    report = {
        "command": command_line("adapter_overhead.py", argv),
        "machine": machine_info(),
        "threads": torch.get_num_threads(),
        "model": MODEL,
        "context_tokens": CONTEXT,
        "steps": steps,
        "target": "adapter prep_forward <= 1.2x native",
        "results": results,
    }
    print_table(report)
    write_json(output_dir(args) / "adapter_overhead.json", report)
    return report


def default_pairs(device: str) -> str:
    # Triton on CPU runs in its interpreter: its timings would say nothing about the adapter.
    return "reference,triton" if device.startswith("cuda") else "reference"


def print_table(report: dict) -> None:
    columns = ("device", "backend", "requests", "prep_forward native", "adapter", "ratio",
               "adapter's own", "forward dispatch", "step ms native", "adapter")  # fmt: skip
    t = table("Adapter vs native, host µs per decode step (median)", columns)
    for r in report["results"]:
        prep, step = r["prep_forward"], r["engine_step_ms"]
        t.add_row(
            r["device"],
            r["backend"],
            str(r["num_requests"]),
            f"{prep['native']['median']:,.0f}",
            f"{prep['adapter']['median']:,.0f}",
            f"{r['prep_forward_ratio']:.2f}x",
            f"{r['adapter_own_us']:,.0f}",
            f"{r['forward_us']['adapter dispatch']:,.1f}",
            f"{step['native']['median']:.2f}",
            f"{step['adapter']['median']:.2f}",
        )
    Console(width=150).print(t)


if __name__ == "__main__":
    main()
