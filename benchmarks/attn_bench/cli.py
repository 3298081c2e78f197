"""The command line: arguments, the GPU and environment checks, the run's header (machine,
parameters), the sections in order, and the partial results, report and plot on the way out
(also after an error, SIGTERM or Ctrl-C)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

import torch
from common import (
    HEAD,
    HKV,
    HQ,
    PAGE,
    REP_MS,
    WARMUP_MS,
    add_out_argument,
    command_line,
    machine_info,
    make_console,
    utc_timestamp,
)

from .config import (
    DTYPE,
    FULL_PARAMS,
    GIB,
    MAX_ROTATE,
    QUICK_PARAMS,
    ROTATE_BELOW,
    SECTIONS,
    SEED,
    TARGETS,
    TOLERANCE,
)
from .decode import bench_decode
from .plot import plot
from .prefill import bench_prefill
from .report import print_report
from .run import Interrupted, Run, err_str
from .sections import bench_ceilings, bench_features, bench_split, bench_window
from .timing import cleanup
from .verdicts import verdicts

BENCHES = {
    "decode": bench_decode,
    "prefill": bench_prefill,
    "window": bench_window,
    "features": bench_features,
    "split": bench_split,
}

NOTES = (
    "SDPA decode peers: best of enable_gqa (q [B,32,1,D]) and packed (q [B,8,4,D], "
    "non-causal; the same math); both recorded",
    "FlexAttention paged uses the page size (16) as its KV block size, as torch's "
    "PagedAttention requires; complete pages are full blocks (no mask_mod)",
    "FlexAttention compile time excluded (first call, recorded as first_call_s)",
    "peer TB/s = our bytes model / peer time, so TB/s ratios are time ratios",
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Attention kernel benchmark (GPU): ours vs SDPA flash/cuDNN and FlexAttention."
    )
    add_out_argument(ap)
    ap.add_argument("--quick", action="store_true", help="a small subset (about 2 minutes)")
    ap.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)} (ceilings always run)",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="soft time budget in seconds: FlexAttention compiles and further shapes are "
        "skipped (and recorded as skipped) once it runs out (default 450 full, 105 quick)",
    )
    ap.add_argument("--no-flex", action="store_true", help="skip the FlexAttention peers")
    ap.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    args = ap.parse_args(argv)
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown or not chosen:
        ap.error(f"--sections: unknown {unknown}; choose from {','.join(SECTIONS)}")
    args.sections = [s for s in SECTIONS if s in chosen]
    return args


def require_compiled_gpu() -> None:
    """Exit with code 2 without CUDA or under the Triton interpreter."""
    if not torch.cuda.is_available():
        print(
            "benchmarks/attention.py needs a CUDA GPU (torch.cuda.is_available() is False); "
            "run it on the GPU machine.",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(2)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print(
            "TRITON_INTERPRET=1 is set: unset it to benchmark the compiled kernels.",
            file=sys.stderr,
        )
        raise SystemExit(2)


def gpu_info() -> dict[str, Any]:
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name,
        "gpu_memory_gib": props.total_memory / GIB,
        "sm_count": props.multi_processor_count,
        "capability": f"{props.major}.{props.minor}",
        "l2_cache_mb": getattr(props, "L2_cache_size", 0) / 1e6,
        "triton_version": triton.__version__,
        "torch_version_full": torch.__version__,
        "cuda_version": torch.version.cuda,
        "cudnn_version": torch.backends.cudnn.version(),
    }


def header(run: Run, argv: Sequence[str] | None) -> dict[str, Any]:
    """What the JSON records before any measurement: the command, machine and parameters."""
    args = run.args
    return {
        "schema": "unified_attn.benchmarks.attention/v1",
        "mode": "quick" if args.quick else "full",
        "command": command_line("attention.py", argv),
        "machine": {**machine_info(), **gpu_info()},
        "timestamp_utc": utc_timestamp(),
        "params": {
            **run.params,
            "sections": args.sections,
            "budget_s": run.budget,
            "no_flex": args.no_flex,
            "heads_q": HQ,
            "heads_kv": HKV,
            "head_size": HEAD,
            "page_size": PAGE,
            "dtype": str(DTYPE),
            "seed": SEED,
            "timer": f"triton.testing.do_bench(warmup={WARMUP_MS}, rep={REP_MS}, median); "
            "CUDA graph over the rotation when the working set < 200 MB",
            "rotation": f"working set < {ROTATE_BELOW / 1e6:.0f} MB: rotate ceil(256 MiB / ws) "
            f"buffers (max {MAX_ROTATE})",
            "decode_bytes": "sum(seq_lens) * Hkv * D * 2 (K, V) * 2 B + Q + output",
            "prefill_flops": "4 * sum over queries of visible keys * Hq * D",
            "tolerance": TOLERANCE,
            "notes": NOTES,
        },
        "targets": TARGETS,
        "errors": [],
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    require_compiled_gpu()
    params = dict(QUICK_PARAMS if args.quick else FULL_PARAMS)
    run = Run(args, params, make_console(180))
    run.out_dir.mkdir(parents=True, exist_ok=True)
    run.results.update(header(run, argv))
    run.log(
        f"{run.results['machine']['gpu']}, torch {torch.__version__}, mode {run.results['mode']}, "
        f"sections {','.join(args.sections)}, budget {run.budget:.0f} s"
    )
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, on_term)
    torch.manual_seed(SEED)
    try:
        run_sections(run)
    except (Interrupted, KeyboardInterrupt) as e:
        run.results["interrupted"] = err_str(e)
        run.log(f"interrupted ({err_str(e)}): writing partial results")
    finally:
        signal.signal(signal.SIGTERM, previous)
        finish(run)
    return run.results


def on_term(signum: int, _frame: Any) -> None:
    raise Interrupted(f"signal {signum}")


def run_sections(run: Run) -> None:
    """The ceilings, then the chosen sections; a section's error is recorded and the next runs."""
    run.results["ceilings"] = bench_ceilings(run)
    run.save()
    for name in run.sections:
        run.log(f"== {name} ==")
        try:
            BENCHES[name](run)
        except Exception as e:
            run.results["errors"].append({"section": name, "error": err_str(e)})
            run.log(f"{name}: ERROR {err_str(e)}")
            with contextlib.suppress(Exception):
                cleanup()
        run.save()


def finish(run: Run) -> None:
    """Verdicts, report and plot of whatever was measured, saved after each step."""
    run.results["verdicts"] = verdicts(run.results)
    run.save()
    print_report(run)
    run.results["png"] = None
    if not run.args.no_plot:
        try:
            if plot(run):
                run.results["png"] = str(run.png_path)
        except Exception as e:
            run.results["errors"].append({"section": "plot", "error": err_str(e)})
    run.save()
    run.console.print(
        f"Wrote {run.json_path}" + (f" and {run.png_path}" if run.results["png"] else "")
    )
