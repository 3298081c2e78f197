"""The `unified-attn run` command: its parser, the engine settings, a workload of requests with
shared prefixes, the run itself and its report (JSON or rich tables)."""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

from unified_attn.runner.engine import LLMEngine
from unified_attn.sampling_params import SamplingParams


def add_parser(commands: Any) -> None:
    run = commands.add_parser(
        "run", help="generate for a workload of requests with shared prefixes and report"
    )
    run.add_argument("--model", default="tiny-llama", help="preset name or checkpoint path")
    run.add_argument("--device", default="cpu")
    run.add_argument("--backend", default=None, help="attention backend (default: auto)")
    run.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16")
    run.add_argument("--num-requests", type=int, default=32)
    run.add_argument("--max-tokens", type=int, default=32)
    run.add_argument("--kv-cache-memory", default=None, help="e.g. 64MiB (CPU default 64MiB)")
    run.add_argument("--block-size", type=int, default=None)
    run.add_argument("--max-num-seqs", type=int, default=64)
    run.add_argument("--max-num-batched-tokens", type=int, default=512)
    run.add_argument("--max-model-len", type=int, default=None)
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--prompt", default=None, help="shared prompt text (default: random ids)")
    run.add_argument("--no-prefix-caching", action="store_true")
    run.add_argument("--batch-invariant", action="store_true")
    run.add_argument("--json", action="store_true", help="print the report as JSON only")
    run.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print_report(report)
    return 0


def engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = {
        "device": args.device,
        "backend": args.backend,
        "dtype": args.dtype,
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "enable_prefix_caching": not args.no_prefix_caching,
        "batch_invariant": args.batch_invariant,
        "seed": args.seed,
    }
    if args.kv_cache_memory is not None or args.device == "cpu":
        kwargs["kv_cache_memory"] = args.kv_cache_memory or "64MiB"
    else:
        kwargs["kv_cache_memory"] = None
    return kwargs


def make_workload(engine: LLMEngine, args: argparse.Namespace) -> list[list[int]]:
    """Requests sharing one of 4 system prefixes (or the given prompt), each with its own tail."""
    rng = random.Random(args.seed)
    vocab = engine.vocab_size
    if args.prompt is not None:
        prefixes = [engine.encode(args.prompt)]
    else:
        prefixes = [[rng.randrange(vocab) for _ in range(96)] for _ in range(4)]
    budget = engine.max_model_len - args.max_tokens - 1
    prompts = []
    for i in range(args.num_requests):
        tail = [rng.randrange(vocab) for _ in range(rng.randint(8, 48))]
        prompts.append((prefixes[i % len(prefixes)] + tail)[: max(budget, 1)])
    return prompts


def run(args: argparse.Namespace) -> dict:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    start = time.perf_counter()
    engine = LLMEngine(args.model, **engine_kwargs(args))
    setup_s = time.perf_counter() - start
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    for prompt in make_workload(engine, args):
        engine.add_request(prompt, params)
    finished = []
    run_start = time.perf_counter()
    columns = ("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())  # fmt: skip
    with Progress(*columns, disable=args.json, transient=True) as progress:
        task = progress.add_task("generating", total=args.num_requests)
        while engine.has_unfinished_requests():
            done = engine.step()
            finished.extend(done)
            progress.advance(task, len(done))
    elapsed = time.perf_counter() - run_start
    return make_report(engine, args, finished, setup_s, elapsed)


def make_report(engine: LLMEngine, args, finished, setup_s: float, elapsed: float) -> dict:
    stats = engine.stats
    prefix = engine.kv_cache_manager.prefix_cache_stats
    return {
        "model": args.model,
        "device": args.device,
        "backend": engine.backend_cls.name,
        "num_requests": len(finished),
        "kv_cache": engine.kv_cache_report.as_dict(),
        "prefix_cache": {
            "queries": prefix.queries,
            "hits": prefix.hits,
            "hit_rate": prefix.hit_rate,
        },
        "preemptions": engine.scheduler.num_preemptions,
        "groups_at_runtime": engine.kv_cache_manager.group_stats(),
        "steps": stats.steps,
        "prefill_tokens": stats.prefill_tokens,
        "generated_tokens": stats.generated_tokens,
        "generated_tokens_per_s": stats.generated_tokens / elapsed if elapsed else 0.0,
        "total_tokens_per_s": (stats.prefill_tokens + stats.decode_tokens) / elapsed
        if elapsed
        else 0.0,
        "mean_step_ms": stats.mean_step_ms,
        "setup_s": setup_s,
        "elapsed_s": elapsed,
        "sample_output": finished[0].text if finished and finished[0].text is not None else None,
    }


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    kv = report["kv_cache"]
    groups = Table(title="KV-cache groups", title_justify="left")
    columns = ("group", "manager", "config", "layers", "page bytes", "blocks/request",
               "freed early", "hit blocks")  # fmt: skip
    for column in columns:
        groups.add_column(column)
    for g, live in zip(kv["groups"], report["groups_at_runtime"], strict=True):
        groups.add_row(str(g["group_id"]), g["manager"], str(g["config"] or ""),
                       str(len(g["layers"])), f"{g['page_bytes']:,}",
                       str(g["blocks_per_request"]), f"{live['blocks_freed_early']:,}",
                       f"{live['hit_blocks']:,}")  # fmt: skip
    console.print(groups)
    summary = Table(title="Run", title_justify="left", show_header=False)
    rows = [
        ("model / backend", f"{report['model']} / {report['backend']} on {report['device']}"),
        ("KV cache", f"{kv['num_blocks']:,} blocks x {kv['bytes_per_block']:,} B "
                     f"(block size {kv['block_size']}) = {kv['total_bytes'] / 2**20:.1f} MiB"),
        ("capacity", f"{kv['capacity_tokens']:,} tokens, max concurrency "
                     f"{kv['max_concurrency']:.1f} at max_model_len {kv['max_model_len']}"),
        ("requests", str(report["num_requests"])),
        ("prefix hit rate", f"{report['prefix_cache']['hit_rate']:.1%}"),
        ("preemptions", str(report["preemptions"])),
        ("generated tokens/s", f"{report['generated_tokens_per_s']:.1f}"),
        ("total tokens/s", f"{report['total_tokens_per_s']:.1f}"),
        ("mean step", f"{report['mean_step_ms']:.2f} ms over {report['steps']} steps"),
    ]  # fmt: skip
    for key, value in rows:
        summary.add_row(key, value)
    console.print(summary)
