"""A whole model step against its hardware limit, host overhead and tensor-parallel scaling.

    python benchmarks/model_step.py [--models llama-3-8b,...] [--tp 1,2,4] [--batches 1,16,64,256]
        [--prefill 2048,8192] [--quick] [--append] [--out DIR]
    python benchmarks/model_step.py --device cpu      # tiny-llama: a smoke run of the control flow

For every model (real shapes with random weights, `model_step_shapes.py`) and tensor-parallel
size (bf16, Triton, CUDA graphs, `gpu_memory_utilization` 0.85 of the memory free once the
model is loaded), in a process of its own (`model_step_run.py`): decode steps at every batch
size (wall step from the engine's own step time, device step from the decode graph replayed
alone, tokens/s, the roofline max(bytes rank 0 reads / copy bandwidth, its FLOPs / matmul
rate), both measured in the same process, the fraction of it each step reaches, host overhead
= wall - device) and one-request prefill steps (tokens/s, fraction of the matmul rate). Sizes
over `torch.cuda.device_count()` are skipped with a note. TP speedups: decode tokens/s at TP=N
over TP=1 at the same batch. Writes `DIR/model_step.json` after every configuration, then
`DIR/model_step.png`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from common import (
    add_out_argument,
    csv_ints,
    make_console,
    output_dir,
    run_header,
    write_json,
)
from model_step_device import install_peer_replay
from model_step_report import plot, print_config, print_speedups
from model_step_run import Settings, measure
from model_step_shapes import CPU_MODELS, GPU_MODELS, SHAPES, register_shapes

from unified_attn.models.presets import PRESETS

SCHEMA = "model_step/1"
SCRIPT = Path(__file__).resolve()
# NCCL's NVLink multicast (NVLS) and symmetric-memory multicast stay off on the lent machines
NCCL_ENVIRONMENT = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}

# At import: each configuration's process runs this script, and the tensor-parallel ranks it
# spawns import it again (as `__mp_main__`); all must know the shapes and replay on request.
register_shapes()
if __name__ in ("__main__", "__mp_main__"):
    install_peer_replay()


# ---- options ------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--device", default="cuda", choices=["cuda", "cpu"])
    add("--models", help=f"comma-separated (default {','.join(GPU_MODELS)}; "
        f"{','.join(CPU_MODELS)} on CPU); any of {', '.join(SHAPES)} or a preset")  # fmt: skip
    add("--tp", default="1,2,4", help="tensor-parallel sizes (default 1,2,4)")
    add("--batches", default="1,16,64,256", help="decode batch sizes (default 1,16,64,256)")
    add("--prefill", help="prefill tokens per step (default 2048,8192; 128,512 on CPU)")
    add("--prompt-len", type=int, default=128, help="decode requests' prompt (default 128)")
    add("--warmup", type=int, default=8, help="decode steps before the timed ones")
    add("--steps", type=int, default=32, help="timed decode steps per batch")
    add("--replays", type=int, default=50, help="timed replays of a decode graph")
    add("--prefill-reps", type=int, default=3, help="timed prefill steps per length")
    add("--gpu-memory-utilization", type=float, default=0.85)
    add("--repetition-penalty", type=float, default=1.0, help="decode requests' (default 1: "
        "none; another value makes their sampling read their outputs)")  # fmt: skip
    add("--kv-cache-memory", default=None, help="KV budget per rank (default: from the "
        "utilization on CUDA, 32MiB on CPU)")  # fmt: skip
    add("--config-timeout", type=float, default=600, help="seconds per configuration")
    add("--quick", action="store_true", help="one model, TP=1, batches 1 and 64, few steps")
    add("--append", action="store_true", help="keep the configurations of DIR/model_step.json "
        "that this run does not measure again")  # fmt: skip
    add("--no-plot", action="store_true")
    add("--job", help=argparse.SUPPRESS)  # a configuration's process: its job file
    add_out_argument(parser)
    args = parser.parse_args(argv)
    args.argv = argv
    return resolve(parser, args)


def resolve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    cpu = args.device == "cpu"
    models = args.models or ",".join(CPU_MODELS if cpu else GPU_MODELS)
    args.models = [m.strip() for m in models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in PRESETS]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)}; choose from "
                     f"{', '.join(sorted(PRESETS))}")  # fmt: skip
    for name in ("tp", "batches", "prefill"):
        text = getattr(args, name) or ("128,512" if cpu else "2048,8192")
        try:
            setattr(args, name, csv_ints(text))
        except ValueError:
            parser.error(f"--{name}: positive integers separated by commas, got {text!r}")
    if not args.repetition_penalty > 0:
        parser.error(f"--repetition-penalty must be > 0, got {args.repetition_penalty}")
    for name in ("prompt_len", "warmup", "steps", "replays", "prefill_reps"):
        least = 0 if name == "warmup" else 1
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')} must be at least {least}")
    if args.quick:
        args.models, args.tp, args.batches = args.models[:1], [1], [1, 64]
        args.steps, args.warmup, args.replays, args.prefill_reps = 8, 2, 10, 1
    if cpu and args.kv_cache_memory is None:
        args.kv_cache_memory = "32MiB"
    return args


def settings_of(args: argparse.Namespace) -> Settings:
    fields = [f.name for f in attrs.fields(Settings)]
    return Settings(**{name: getattr(args, name) for name in fields})


# ---- configurations, each in a process of its own -------------------------------------------


def configurations(args: argparse.Namespace, console: Any) -> tuple[list[tuple[str, int]], list]:
    """(model, tp) pairs to measure, and a note for each size this machine cannot run."""
    gpus = torch.cuda.device_count() if args.device == "cuda" else None
    sizes = [n for n in args.tp if gpus is None or n <= gpus]
    notes = [f"tp={n} skipped: this machine has {gpus} CUDA devices" for n in args.tp
             if n not in sizes]  # fmt: skip
    for note in notes:
        console.print(f"[yellow]{note}[/yellow]")
    return [(m, n) for m in args.models for n in sizes], notes


def run_job(settings: Settings, model: str, tp: int, timeout: float) -> dict[str, Any]:
    """Measure one configuration in a new process (`--job`): a fresh device, group and memory,
    whatever the configuration before it left. Its process group is killed on a timeout."""
    with tempfile.TemporaryDirectory(prefix="model_step_") as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps({"model": model, "tp": tp, "settings": attrs.asdict(settings),
                                   "result": str(Path(tmp) / "result.json")}))  # fmt: skip
        proc = subprocess.Popen([sys.executable, str(SCRIPT), "--job", str(job)],
                                start_new_session=True)  # fmt: skip
        try:
            end = f"exit code {proc.wait(timeout=timeout)}"
        except subprocess.TimeoutExpired:  # a result may be written already (a hung teardown)
            kill_job(proc)
            end = f"killed after {timeout:g} s"
        except BaseException:  # interrupted or terminated: the job and its ranks go too
            kill_job(proc)
            raise
        result = Path(tmp) / "result.json"
        if result.exists():
            return {**json.loads(result.read_text()), "process_end": end}
        return {"model": model, "tp": tp, "error": f"{end}, no result"}


def kill_job(proc: subprocess.Popen) -> None:
    """The job's process and the ranks it spawned (its own session: `start_new_session`)."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """A run terminated meanwhile (a time limit's SIGTERM) unwinds, so `run_job` kills its
    job; the previous handler comes back after."""
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def job_main(path: str) -> None:
    """A configuration's process: measure, write the result (or the error) where asked."""
    job = json.loads(Path(path).read_text())
    model, tp = job["model"], job["tp"]
    try:
        result = measure(Settings(**job["settings"]), model, tp)
    except Exception as error:
        result = {"model": model, "tp": tp, "error": f"{type(error).__name__}: {error}"}
        write_json(Path(job["result"]), result)
        raise
    write_json(Path(job["result"]), result)


# ---- the report -----------------------------------------------------------------------------


def add_speedups(configs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Decode tokens/s at TP=N over TP=1 of the same model and batch, on every row (TP=1
    included, 1.0) and as `{model: {"tpN": {batch: x}}}`."""
    base = {(c["model"], r["batch"]): r["tokens_per_s"]
            for c in configs if c["tp"] == 1 and "decode" in c for r in c["decode"]}  # fmt: skip
    table: dict[str, dict[str, dict[str, float]]] = {}
    for config in configs:
        for row in config.get("decode", []):
            one = base.get((config["model"], row["batch"]))
            row["tp_speedup"] = None if one is None else row["tokens_per_s"] / one
            if one is not None and config["tp"] > 1:
                per_tp = table.setdefault(config["model"], {}).setdefault(f"tp{config['tp']}", {})
                per_tp[str(row["batch"])] = row["tp_speedup"]
    return table


def previous_configs(path: Path, measured: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """`--append`: the configurations of an earlier JSON that this run does not repeat."""
    if not path.exists():
        return []
    old = json.loads(path.read_text()).get("configs", [])
    return [c for c in old if (c["model"], c["tp"]) not in measured]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    for name, value in NCCL_ENVIRONMENT.items():
        os.environ.setdefault(name, value)  # before any process group; the ranks inherit it
    args = parse_args(argv)
    if args.job:
        job_main(args.job)
        return {}
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/model_step.py needs a CUDA GPU (or --device cpu)", file=sys.stderr)
        raise SystemExit(2)
    console = make_console(160)
    path = output_dir(args) / "model_step.json"
    todo, notes = configurations(args, console)
    report = run_header(SCHEMA, "model_step.py", args.quick, args.argv)
    settings = settings_of(args)
    report.update({"settings": attrs.asdict(settings), "notes": notes,
                   "environment": {k: os.environ[k] for k in NCCL_ENVIRONMENT}})  # fmt: skip
    configs = previous_configs(path, todo) if args.append else []
    report.update({"configs": configs, "tp_speedup": add_speedups(configs)})
    write_json(path, report)
    for model, tp in todo:
        console.print(f"[bold]{model}, tp={tp}[/bold]")
        with exit_on_sigterm():
            configs.append(run_job(settings, model, tp, args.config_timeout))
        report["configs"] = configs
        report["tp_speedup"] = add_speedups(configs)
        write_json(path, report)
        print_config(console, configs[-1])
    print_speedups(console, report)
    if not args.no_plot:
        plot(report, path.with_suffix(".png"), console)
    console.print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
