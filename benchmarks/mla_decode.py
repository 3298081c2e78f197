"""MLA decode benchmark: the Triton weight-absorbed MLA kernel (`mla_ops.mla_attention`) over a
paged latent cache, against a torch peer measured in the same run.

    python benchmarks/mla_decode.py [--out DIR] [--heads 128,16] [--batches 1,16,64,128]
                                    [--contexts 1024,8192,32768] [--num-segments N]
                                    [--tiles BH,BQ,BN,WARPS,STAGES[,PROGRAMS_PER_SM]]
                                    [--no-peers] [--no-plot] [--quick] [--l2-resident] [--fp8]

The benchmark lives in the `mla_bench` package next to this script; its docstring describes the
shapes, peers, timing and outputs. This script keeps the arguments, the run record and `main`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
from common import (
    add_out_argument,
    command_line,
    machine_info,
    output_dir,
    utc_timestamp,
    write_json,
)
from mla_bench.checks import compiled_kernels, oracle_check
from mla_bench.config import FULL, QUICK, SCHEMA, SEED, TARGET_TB_S, TOLERANCE
from mla_bench.report import plot, print_table, shape_line, verdicts
from mla_bench.shape import bench_shape, tiles_of
from mla_bench.timing import Bench

# ---- arguments and environment -----------------------------------------------------------------


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_argument(ap)
    ap.add_argument(
        "--quick", action="store_true", help="smoke run, tiny shapes (CPU: interpreter)"
    )
    ap.add_argument("--heads", type=int_list, help="query heads, comma-separated")
    ap.add_argument("--batches", type=int_list, help="batch sizes, comma-separated")
    ap.add_argument("--contexts", type=int_list, help="context lengths, comma-separated")
    ap.add_argument(
        "--tiles",
        action="append",
        type=int_list,
        metavar="BH,BQ,BN,WARPS,STAGES[,PROGRAMS_PER_SM[,KERNEL]]",
        help="tile config(s) to time instead of the default (repeatable)",
    )
    ap.add_argument(
        "--num-segments",
        type=int,
        default=None,
        help="force the split-KV segment count (default: plan_mla decides)",
    )
    ap.add_argument("--no-peers", action="store_true", help="time ours only")
    ap.add_argument(
        "--l2-resident",
        action="store_true",
        help="diagnostic: every request reads the same 8 pages (L2 holds them), so the time is "
        "the kernel's with DRAM latency and bandwidth taken away; TB/s then counts the bytes "
        "as if read from DRAM",
    )
    ap.add_argument(
        "--fp8",
        action="store_true",
        help="an fp8 (e4m3) latent cache with a scale (the portable kernel dequantizes it; the "
        "peers gather and dequantize); TB/s then counts one byte per latent element",
    )
    ap.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    args = ap.parse_args(argv)
    params = dict(QUICK if args.quick else FULL)
    for key in ("heads", "batches", "contexts"):
        if getattr(args, key):
            params[key] = getattr(args, key)
    for tiles in args.tiles or []:
        if len(tiles) not in (5, 6, 7) or tiles[6:] not in ([], [0], [1], [2], [3]):
            ap.error(
                "--tiles takes BH,BQ,BN,WARPS,STAGES[,PROGRAMS_PER_SM[,KERNEL]] (KERNEL 0: "
                "portable, 1: Hopper lockstep, 2: Hopper warp-specialized, 3: portable with "
                f"swapped products), got {tiles}"
            )
    params["l2_resident"] = args.l2_resident
    params["fp8"] = args.fp8
    args.params = params
    args.argv = argv
    return args


def require_device(quick: bool) -> torch.device:
    """CUDA for a real run (exit code 2 without it); the CPU interpreter for `--quick`."""
    if quick:
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
            return torch.device("cpu")
        return torch.device("cuda")
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1":
        print(
            "benchmarks/mla_decode.py needs a CUDA GPU without TRITON_INTERPRET=1; use --quick "
            "for a CPU smoke run.",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(2)
    return torch.device("cuda")


# ---- main -------------------------------------------------------------------------------------


def header(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    machine = machine_info()
    if device.type == "cuda":
        from attn_bench.cli import gpu_info

        machine.update(gpu_info())
    return {
        "schema": SCHEMA,
        "mode": "quick" if args.quick else "full",
        "command": command_line("mla_decode.py", args.argv),
        "machine": machine,
        "timestamp_utc": utc_timestamp(),
        "params": {
            **args.params,
            "tiles": args.tiles,
            "num_segments": args.num_segments,
            "latent_bytes": "sum(seq_len) * (L + R) * cache dtype bytes (fp8: 1)",
            "flops": "2 * H * (2L + R) * sum(seq_len)",
            "tolerance": TOLERANCE,
            "seed": SEED,
        },
        "target_tb_s": TARGET_TB_S,
        "shapes": [],
        "errors": [],
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = require_device(args.quick)  # before the kernels are imported (the interpreter)
    for tiles in args.tiles or []:
        try:
            tiles_of(tiles)
        except ValueError as e:
            print(f"--tiles {','.join(map(str, tiles))}: {e}", file=sys.stderr)
            raise SystemExit(2) from None
    bench = Bench(device)
    out_dir = output_dir(args)
    results = header(args, device)
    json_path = out_dir / "mla_decode.json"
    gen = torch.Generator().manual_seed(SEED)
    torch.manual_seed(SEED)
    results["ceilings"] = bench.ceilings()
    results["oracle_check"] = oracle_check(bench, args.params, gen)
    write_json(json_path, results)
    p = args.params
    for heads in p["heads"]:
        for batch in p["batches"]:
            for ctx in p["contexts"]:
                try:
                    rec = bench_shape(bench, args, results["ceilings"], heads, batch, ctx, gen)
                    results["shapes"].append(rec)
                    bench.log(shape_line(rec))
                except Exception as e:
                    results["errors"].append(
                        {"shape": [heads, batch, ctx], "error": f"{type(e).__name__}: {e}"[:800]}
                    )
                    bench.log(f"H={heads} B={batch} ctx={ctx}: ERROR {e}")
                write_json(json_path, results)
    results["verdicts"] = verdicts(results)
    if bench.gpu:
        results["compiled"] = compiled_kernels()
        for k in results["compiled"]:
            bench.log(f"compiled: {k}")
    results["png"] = None
    if not args.no_plot and results["shapes"] and plot(results, out_dir / "mla_decode.png"):
        results["png"] = str(out_dir / "mla_decode.png")
    write_json(json_path, results)
    print_table(results)
    return results


if __name__ == "__main__":
    main()
