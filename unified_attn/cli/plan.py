"""The `unified-attn plan` command: its parser (`add_parser`), `main`, the settings it reports,
the check that a budget holds a block, the capacity plot (`--png`, needs matplotlib) and the
printed plan (`print_plan`, `describe_settings`, `describe_gain`). The capacity model it prints
is `plan.py`.

`unified-attn plan` takes the defaults of `unified-attn run` on CPU (tiny-llama, 64MiB, the
model's max_position_embeddings, 512 tokens in flight, float32) and prints the settings it used.
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import torch

from unified_attn.cli.arguments import (
    DTYPES,
    kv_cache_dtype,
    memory_size,
    positive_int,
)
from unified_attn.harness.capacity import (
    PlanConfig,
    capacity,
    compare,
    full_capacity,
    resolve_model_config,
)
from unified_attn.models.families import family_of
from unified_attn.runner.memory import format_memory
from unified_attn.runner.model_source import (
    DEFAULT_MODEL,
    default_dtype,
    resolve_max_model_len,
)
from unified_attn.tensor_specs import as_dtype


def add_parser(commands: Any) -> None:
    plan = commands.add_parser(
        "plan",
        help="KV-cache groups and capacity, next to full allocation",
        description="KV-cache groups and capacity of a model under a memory budget, next to "
        "full attention on every layer. The defaults are those of `unified-attn run` on CPU; "
        "the settings used are printed with the plan.",
    )
    plan.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="preset, real-model shape or checkpoint (see `unified-attn models`)",
    )
    plan.add_argument(
        "--kv-cache-memory",
        type=memory_size,
        default="64MiB",
        help="KV-cache budget, e.g. 64MiB, 40GiB, 1TiB",
    )
    plan.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="tokens per request (default: the model's max_position_embeddings)",
    )
    plan.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=512,
        help="tokens in flight per request (sizes window groups)",
    )
    plan.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="the device the plan is for: it sets the default --dtype, as serving does "
        "(float32 on cpu, bfloat16 on cuda); nothing is allocated",
    )
    plan.add_argument(
        "--dtype",
        default=None,
        choices=DTYPES,
        help="model dtype, the KV-cache dtype with --kv-cache-dtype auto (default: what "
        "`run` uses on --device)",
    )
    plan.add_argument(
        "--kv-cache-dtype",
        type=kv_cache_dtype,
        default="auto",
        help="auto (the model dtype) or fp8 (float8 e4m3: one byte per element)",
    )
    plan.add_argument(
        "--block-size",
        type=positive_int,
        default=None,
        help="tokens per block (default: 16, or what every backend accepts)",
    )
    plan.add_argument(
        "--tensor-parallel-size",
        type=positive_int,
        default=1,
        help="plan one rank's shard (its local heads) under --kv-cache-memory per GPU",
    )
    plan.add_argument("--json", action="store_true", help="print the report as JSON only")
    plan.add_argument(
        "--png",
        default=None,
        help="write capacity vs context length to this PNG (needs matplotlib)",
    )
    plan.set_defaults(handler=main)


def main(args: Any) -> int:
    if args.png:
        require_matplotlib()
    config = resolve_model_config(args.model)
    if args.tensor_parallel_size > 1:  # every rank holds the same shard: plan rank 0's
        # the family's shard (DeepSeek's latent caches are replicated: local heads)
        config = family_of(config).shard_config(config, args.tensor_parallel_size)
    max_model_len = resolve_max_model_len(args.max_model_len, config)
    if args.dtype is None:  # what serving on the device would use
        args.dtype = str(default_dtype(torch.device(args.device))).removeprefix("torch.")
    kwargs = dict(dtype=as_dtype(args.dtype), block_size=args.block_size,
                  max_in_flight_tokens=args.max_num_batched_tokens,
                  kv_cache_dtype=args.kv_cache_dtype)  # fmt: skip
    report = compare(config, args.kv_cache_memory, max_model_len, **kwargs)
    check_some_blocks_fit(report, args.kv_cache_memory)
    report["settings"] = settings(args, max_model_len, report["hybrid"]["block_size"])
    if args.png:
        report["png"] = plot_capacity(config, args.kv_cache_memory, args.png, **kwargs)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_plan(report)
    return 0


def settings(args: Any, max_model_len: int, block_size: int) -> dict[str, Any]:
    """What the plan was computed with, defaults included (`kv_cache_dtype` when not the
    model dtype)."""
    settings = {
        "model": args.model,
        "kv_cache_memory": args.kv_cache_memory,
        "max_model_len": max_model_len,
        "max_in_flight_tokens": min(args.max_num_batched_tokens, max_model_len),
        "dtype": args.dtype,
        "device": args.device,
        "block_size": block_size,
        "tensor_parallel_size": args.tensor_parallel_size,
    }
    if args.kv_cache_dtype != "auto":
        settings["kv_cache_dtype"] = args.kv_cache_dtype
    return settings


def check_some_blocks_fit(report: dict[str, Any], memory: int) -> None:
    """A budget that holds no block besides the null block has no capacity to compare."""
    for name in ("hybrid", "full"):
        plan = report[name]
        if plan["num_blocks"] == 0:
            raise ValueError(
                f"--kv-cache-memory {format_memory(memory)} holds no KV-cache block with "
                f"{name} allocation: a block takes {plan['bytes_per_block']:,} bytes and one "
                f"more is the null block; give at least {2 * plan['bytes_per_block']:,} bytes"
            )


def matplotlib_installed() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def require_matplotlib() -> None:
    if not matplotlib_installed():
        raise ValueError(
            "--png needs matplotlib, which is not installed; install it with "
            "pip install 'unified_attn[plot]' (or pip install matplotlib), or leave out --png"
        )


def plot_capacity(config: PlanConfig, memory: int, path: str, **kwargs: Any) -> str:
    """Capacity in tokens against max_model_len, hybrid vs full allocation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [2**k for k in range(12, 18)]
    hybrid = [capacity(config, memory, n, **kwargs).capacity_tokens for n in lengths]
    full = [full_capacity(config, memory, n, **kwargs).capacity_tokens for n in lengths]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(lengths, hybrid, marker="o", label="per-group managers")
    ax.plot(lengths, full, marker="s", label="full attention everywhere")
    ax.set(xscale="log", xlabel="max_model_len", ylabel="KV capacity (tokens)",
           title=f"{config.name}: {memory / 2**30:.0f} GiB of KV cache")  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return path


def print_plan(report: dict[str, Any]) -> None:
    from rich.table import Table

    from unified_attn.harness.report_console import ReportConsole

    console = ReportConsole()
    if "settings" in report:
        console.print(describe_settings(report["settings"]))
    groups = Table(title=f"{report['model']}: KV-cache groups", title_justify="left")
    for column in ("manager", "config", "layers", "block size", "page bytes", "waste",
                   "blocks/request"):  # fmt: skip
        groups.add_column(column)
    bytes_per_block = report["hybrid"]["bytes_per_block"]
    for g in report["hybrid"]["groups"]:
        waste = g["wasted_bytes_per_block"] / bytes_per_block if bytes_per_block else 0.0
        groups.add_row(g["manager"], str(g["config"] or ""), str(g["layers"]),
                       str(g["block_size"]), f"{g['page_bytes']:,}", f"{waste:.1%}",
                       f"{g['blocks_per_request']:,}")  # fmt: skip
    console.print(groups)
    summary = Table(title="Capacity", title_justify="left")
    for column in ("", "bytes/block", "blocks", "capacity (tokens)", "max concurrency"):
        summary.add_column(column)
    for name in ("hybrid", "full"):
        c = report[name]
        summary.add_row(name, f"{c['bytes_per_block']:,}", f"{c['num_blocks']:,}",
                        f"{c['capacity_tokens']:,}", f"{c['max_concurrency']:.2f}")  # fmt: skip
    console.print(summary)
    console.print(describe_gain(report))
    for name in ("hybrid", "full"):
        if not report[name]["fits_one_request"]:
            console.print(
                f"note: with {name} allocation one request of max_model_len "
                f"{report['max_model_len']:,} does not fit this budget (`run` would refuse it)"
            )


def describe_settings(settings: dict[str, Any]) -> str:
    n = settings["tensor_parallel_size"]
    ranks = f" per rank of {n} (tensor parallelism)" if n > 1 else ""
    kv_dtype = (
        f" with an {settings['kv_cache_dtype']} KV cache" if "kv_cache_dtype" in settings else ""
    )
    return (
        f"plan for {settings['model']}: KV cache {format_memory(settings['kv_cache_memory'])}"
        f"{ranks}, max_model_len {settings['max_model_len']:,}, "
        f"{settings['max_in_flight_tokens']:,} tokens in flight per request, "
        f"{settings['dtype']} (on {settings['device']}){kv_dtype}, "
        f"block size {settings['block_size']}"
    )


def describe_gain(report: dict[str, Any]) -> str:
    ratios = (
        f"capacity ratio {report['capacity_ratio']:.3f}x, theoretical "
        f"{report['theoretical_ratio']:.3f}x"
    )
    fraction = report["fraction_of_theoretical_gain"]
    if fraction is None:
        loss = 1 - report["capacity_ratio"]
        return (
            f"{ratios}: no gain is possible at max_model_len {report['max_model_len']:,} "
            "(every layer keeps the whole context)"
            + (f"; the per-group plan holds {loss:.1%} fewer tokens" if loss > 0 else "")
        )
    where = f"(max_model_len {report['max_model_len']:,})"
    if fraction < 0:
        return f"{ratios}: the per-group plan loses capacity, {fraction:.1%} of the gain {where}"
    return f"{ratios}: {fraction:.1%} of the theoretical gain {where}"
