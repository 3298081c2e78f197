"""Helpers shared by the benchmark scripts of this directory: the recorded command line, the JSON
and PNG outputs, rich tables, GPU timing and the prefill launch that the GPU scripts tune and
profile.

The scripts run as `python benchmarks/<script>.py`, so this directory is on `sys.path` and they
import this module as `common`.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console, JustifyMethod
from rich.table import Table

RESULTS_DIR = "benchmarks/results"  # default output directory, relative to the repository root
QUICK_DIR = "benchmarks/results/quick"  # `--quick` runs: a scratch folder git ignores


def add_out_argument(parser: Any) -> None:
    """`--out DIR`; without it, full runs write the committed results and `--quick` runs a
    scratch folder, so a smoke run never overwrites measured figures."""
    parser.add_argument(
        "--out",
        default=None,
        help=f"output directory (default {RESULTS_DIR}; {QUICK_DIR} with --quick)",
    )


def output_dir(args: Any) -> Path:
    return Path(args.out or (QUICK_DIR if getattr(args, "quick", False) else RESULTS_DIR))


# The attention shape of the GPU benchmarks: query heads, KV heads, head size, page (block) size.
HQ, HKV, HEAD, PAGE = 32, 8, 128, 16

WARMUP_MS, REP_MS = 25, 100  # `triton.testing.do_bench` windows


# ---- run record ------------------------------------------------------------------------------


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """The command of this run, as recorded in the JSON (`argv` None: the process's arguments)."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python", f"benchmarks/{script}", *args])


def utc_timestamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def run_header(schema: str, script: str, quick: bool, argv: Sequence[str] | None) -> dict:
    """The fields a CPU benchmark's JSON opens with: schema, mode, command, machine, time."""
    from unified_attn.harness.bench import machine_info

    return {
        "schema": schema,
        "mode": "quick" if quick else "full",
        "command": command_line(script, argv),
        "machine": machine_info(),
        "timestamp_utc": utc_timestamp(),
    }


def write_json(
    path: Path, data: Any, *, indent: int = 2, default: Callable[[Any], Any] | None = None
) -> None:
    """Write `data` to `path`, creating its directory, through a temporary file: a reader never
    sees a half-written file (the attention benchmark rewrites it after every shape)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=indent, default=default) + "\n")
    tmp.replace(path)


# ---- text report -----------------------------------------------------------------------------


def make_console(width: int) -> Console:
    """The terminal's console, or one `width` columns wide when the output is not a terminal."""
    console = Console()
    return console if console.is_terminal else Console(width=width)


def table(title: str, columns: Iterable[str], justify: JustifyMethod = "right") -> Table:
    t = Table(title=title)
    for column in columns:
        t.add_column(column, justify=justify)
    return t


def status_markup(met: bool | None) -> str:
    """A target's status as rich markup (None: not comparable)."""
    return {True: "[green]met[/]", False: "[red]missed[/]", None: "n/a"}[met]


# ---- plot ------------------------------------------------------------------------------------


def pyplot(console: Console) -> Any:
    """`matplotlib.pyplot` on the Agg backend, or None (with a note) if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        console.print("[yellow]matplotlib is not installed: skipping the PNG.[/yellow]")
        return None
    return plt


def save_figure(fig: Any, path: Path, dpi: int) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


# ---- GPU -------------------------------------------------------------------------------------


def gpu_ms(fn: Callable[[], Any]) -> float:
    """Median ms per call of `fn` by `triton.testing.do_bench` (which clears L2 before each)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median"))


def prefill_launch(
    length: int, *, page: int = PAGE, context: int = 0, **kwargs: Any
) -> tuple[torch.Tensor, Callable[[], Any]]:
    """One causal bf16 prefill of `length` tokens after `context` cached ones (a chunked
    prefill) through the Triton kernel, on random data in a randomly permuted paged cache of
    `page`-token pages: the queries and the launch (`kwargs` go to the kernel)."""
    from unified_attn.backends.triton import ops

    keys = context + length
    nb = keys // page + 1
    cache = torch.randn(nb + 1, 2, page, HKV, HEAD, device="cuda", dtype=torch.bfloat16)
    block_table = (torch.randperm(nb, device="cuda").to(torch.int32) + 1)[None]
    q = torch.randn(length, HQ, HEAD, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    qsl = torch.tensor([0, length], dtype=torch.int32, device="cuda")
    seq = torch.tensor([keys], dtype=torch.int32, device="cuda")
    launch = functools.partial(
        ops.unified_attention, q, cache[:, 0], cache[:, 1], out, query_start_loc=qsl,
        seq_lens=seq, block_table=block_table, num_seqs=1, max_query_len=length,
        scale=HEAD**-0.5, **kwargs,
    )  # fmt: skip
    return q, launch


def prefill_flops(length: int, context: int = 0) -> float:
    """Causal attention FLOPs of `length` queries after `context` keys: 4 * Hq * D per visible
    (query, key) pair."""
    return 4 * HQ * HEAD * (length * context + length * (length + 1) / 2)
