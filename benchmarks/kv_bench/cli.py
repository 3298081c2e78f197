"""The command line: arguments, the run's header (command, machine, parameters, targets), the
sections in order, the decode profile when asked for or when the hybrid decode misses its target,
then the report, the PNG and the JSON. `--lookup` runs the lookup section alone instead."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common import (
    add_out_argument,
    make_console,
    output_dir,
    run_header,
    write_json,
)
from rich.console import Console

from .block_pool import bench_pool
from .churn import bench_churn
from .config import (
    BLOCK_SIZE,
    CONFIGS,
    DECODE_TARGET_REQUESTS,
    DECODE_TARGET_US,
    FLAT_MAX_RATIO,
    FULL_PARAMS,
    HYBRID,
    MAX_MODEL_LEN,
    QUICK_PARAMS,
    SEED,
    SLIDING_WINDOW,
)
from .decode import bench_decode
from .decode_profile import profile_decode
from .lookup import LOOKUP_CONFIGS, LOOKUP_PARAMS, LOOKUP_PROMPT_LENS, bench_lookup
from .plot import plot
from .prefill import bench_prefill
from .report import lookup_table, print_report
from .verdicts import verdicts


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="KV-cache manager micro-benchmarks (CPU, pure Python)."
    )
    ap.add_argument("--quick", action="store_true", help="small workloads (smoke test)")
    add_out_argument(ap)
    ap.add_argument(
        "--profile",
        action="store_true",
        help="always cProfile the hybrid decode (by default only when it misses the target)",
    )
    ap.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    ap.add_argument(
        "--lookup",
        action="store_true",
        help="only the prefix-cache lookup benchmark (get_computed_blocks; writes kv_lookup.json)",
    )
    return ap.parse_args(argv)


def shared_params() -> dict[str, Any]:
    """The settings every section of this benchmark runs with."""
    return {
        "block_size": BLOCK_SIZE,
        "max_model_len": MAX_MODEL_LEN,
        "seed": SEED,
        "timer": "time.perf_counter_ns",
        "gc": "enabled; gc.collect() before each measured section",
    }


def header(args: argparse.Namespace, params: dict[str, Any], argv: Sequence[str] | None) -> dict:
    """What the JSON records before any measurement: the command, machine and parameters."""
    return {
        **run_header("unified_attn.benchmarks.kv_manager/v1", "kv_manager.py", args.quick, argv),
        "params": {**params, **shared_params(), "sliding_window": SLIDING_WINDOW},
        "targets": {
            "hybrid_decode_step_us": DECODE_TARGET_US,
            "hybrid_decode_num_requests": DECODE_TARGET_REQUESTS,
            "block_pool_flat_max_over_min": FLAT_MAX_RATIO,
        },
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    params = dict(QUICK_PARAMS if args.quick else FULL_PARAMS)
    console = make_console(150)
    out_dir = output_dir(args)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.lookup:
        return main_lookup(args, argv, console, out_dir)
    results: dict[str, Any] = header(args, params, argv)
    t_start = time.perf_counter()
    with console.status("prefill/admission…"):
        results["prefill"] = {name: bench_prefill(name, params) for name in CONFIGS}
    with console.status("decode…"):
        results["decode"] = {name: bench_decode(name, params) for name in CONFIGS}
    with console.status("churn…"):
        results["churn"] = {name: bench_churn(name, params) for name in CONFIGS}
    with console.status("block pool…"):
        results["block_pool"] = {str(n): bench_pool(n, params) for n in params["pool_sizes"]}
    results["verdicts"] = verdicts(results)
    hybrid = results["verdicts"].get("hybrid_decode_step", {})
    need_profile = args.profile or (
        not args.quick and hybrid and hybrid["measured_median_us"] > DECODE_TARGET_US
    )
    if need_profile:
        with console.status("profiling the hybrid decode…"):
            results["decode_profile"] = profile_decode(HYBRID, params)
    results["elapsed_s"] = time.perf_counter() - t_start

    print_report(results, console)
    json_path = out_dir / "kv_manager.json"
    png_path = out_dir / "kv_manager.png"
    results["png"] = None
    if not args.no_plot and plot(results, png_path, console):
        results["png"] = str(png_path)
    write_json(json_path, results)
    console.print(f"Wrote {json_path}" + (f" and {png_path}" if results["png"] else ""))
    return results


def main_lookup(
    args: argparse.Namespace, argv: Sequence[str] | None, console: Console, out_dir: Path
) -> dict[str, Any]:
    """`--lookup`: the `get_computed_blocks` benchmark alone, to `<out>/kv_lookup.json`."""
    params = LOOKUP_PARAMS["quick" if args.quick else "full"]
    schema = "unified_attn.benchmarks.kv_lookup/v1"
    results: dict[str, Any] = {
        **run_header(schema, "kv_manager.py", args.quick, argv),
        "params": {
            **params,
            **shared_params(),  # each configuration names its own sliding window
            "configs": list(LOOKUP_CONFIGS),
            "prompt_lens": list(LOOKUP_PROMPT_LENS),
        },
    }
    t_start = time.perf_counter()
    with console.status("prefix-cache lookups…"):
        results["lookup"] = bench_lookup(params)
    results["elapsed_s"] = time.perf_counter() - t_start
    console.print(lookup_table(results["lookup"]))
    json_path = out_dir / "kv_lookup.json"
    write_json(json_path, results)
    console.print(f"Wrote {json_path}")
    return results
