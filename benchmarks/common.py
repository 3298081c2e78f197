"""Helpers shared by the benchmark scripts of this directory: the recorded command line, the JSON
and PNG outputs, rich tables, GPU timing, the prefill launch that the GPU scripts tune and
profile, robust summaries (`percentile`, `summary`) and a description of the machine
(`machine_info`).

The scripts run as `python benchmarks/<script>.py`, so this directory is on `sys.path` and they
import this module as `common`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from importlib import metadata
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


def csv_ints(text: str) -> list[int]:
    """An argparse type: positive integers separated by commas ("1,64,256")."""
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise ValueError(text)
    return values


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
    """The fields a benchmark's JSON opens with: schema, mode, command, machine, time, and the
    library's switches set in the environment (`UNIFIED_ATTN_*`: e.g. the decode-row GEMM off)."""
    return {
        "schema": schema,
        "mode": "quick" if quick else "full",
        "command": command_line(script, argv),
        "machine": machine_info(),
        "timestamp_utc": utc_timestamp(),
        "switches": {k: v for k, v in sorted(os.environ.items()) if k.startswith("UNIFIED_ATTN_")},
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


def save_run(
    args: Any, stem: str, results: dict, plot: Callable[[dict, Path, Console], None],
    report: Callable[[dict, Console], None], console: Console,
) -> None:  # fmt: skip
    """A finished run: `DIR/<stem>.json`, `DIR/<stem>.png` (`plot`), then the tables (`report`)."""
    out = output_dir(args)
    write_json(out / f"{stem}.json", results)
    plot(results, out / f"{stem}.png", console)
    report(results, console)


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


def capture_graph(calls: Sequence[Callable[[], Any]]) -> Any:
    """`calls` captured in order in one CUDA graph, after one run of them on a side stream
    (compiles and warms up outside the capture); returns the `torch.cuda.CUDAGraph`."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return graph


def warm_up_gpu(seconds: float = 0.3) -> None:
    """Busy the GPU with matmuls for `seconds`: after seconds of host work (compiling) an idle
    H200 ran the next timed kernel up to 2.5x slower (benchmarks/README.md, Mamba-2 kernels)."""
    import time

    import torch

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(8):
            a @ a
        torch.cuda.synchronize()


def graph_replay_ms(graph: Any, windows: int = 5, replays: int = 10) -> float:
    """ms per replay of a captured CUDA graph: the median of `windows` windows of `replays`
    back-to-back replays (CUDA events), after one window of warm-up."""
    import torch

    times = []
    for _ in range(windows + 1):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return statistics.median(times[1:])


def gpu_ms(fn: Callable[[], Any]) -> float:
    """Median ms per call of `fn` by `triton.testing.do_bench` (which clears L2 before each)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median"))


def paired_ms(fns: dict[str, Callable[[], Any]], rounds: int = 3) -> dict[str, list[float]]:
    """`gpu_ms` of every fn in each of `rounds` rounds, the fns taken in turn (A B A B ...), so a
    drift of the GPU's speed during a row (an H200 idle since the machine started ran its first
    timed kernels up to 2.5x slower) reaches every side alike -> name: the rounds' times (take
    `statistics.median`)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(gpu_ms(fn))
    return times


def prefill_flops(length: int, context: int = 0) -> float:
    """Causal attention FLOPs of `length` queries after `context` keys: 4 * Hq * D per visible
    (query, key) pair."""
    return 4 * HQ * HEAD * (length * context + length * (length + 1) / 2)


def prefill_case(
    length: int, *, context: int = 0, page: int = PAGE, **kwargs: Any
) -> dict[str, Any]:
    """Queries, dense K / V `[1, Hkv, keys, D]` (the same for every page size, for the peers),
    the same keys in a permuted paged cache of `page`-token pages, and the Triton kernel's
    causal launch over them (`kwargs` go to the kernel): one prefill of `length` tokens after
    `context` cached ones (a chunked prefill)."""
    from unified_attn.backends.triton import ops

    gen = torch.Generator(device="cuda").manual_seed(length + context)
    keys = context + length
    q = torch.randn(length, HQ, HEAD, generator=gen, device="cuda").to(torch.bfloat16)
    k, v = (
        torch.randn(1, HKV, keys, HEAD, generator=gen, device="cuda").to(torch.bfloat16)
        for _ in range(2)
    )
    pages = -(-keys // page)
    table = (torch.randperm(pages, generator=gen, device="cuda").int() + 1)[None]
    cache = torch.zeros(pages + 1, 2, page, HKV, HEAD, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(keys, device="cuda")
    blocks = table[0, pos // page].long()
    for i, dense in enumerate((k, v)):
        cache[blocks, i, pos % page] = dense[0].transpose(0, 1)
    out = torch.empty_like(q)
    launch = functools.partial(
        ops.unified_attention, q, cache[:, 0], cache[:, 1], out,
        query_start_loc=torch.tensor([0, length], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([keys], dtype=torch.int32, device="cuda"), block_table=table,
        num_seqs=1, max_query_len=length, scale=HEAD**-0.5, **kwargs,
    )  # fmt: skip
    return {"q": q, "launch": launch, "k": k, "v": v, "flops": prefill_flops(length, context)}


def sdpa_prefill(case: dict[str, Any], context: int) -> dict[str, Any]:
    """SDPA flash and cuDNN on `prefill_case`'s dense keys (a bottom-right causal mask for a
    chunk): per backend its output and TFLOP/s, or the error it refused the shape with."""
    qh = case["q"].transpose(0, 1)[None]
    length = qh.shape[2]
    extra: dict[str, Any] = {"is_causal": True}
    if context:
        from torch.nn.attention.bias import causal_lower_right

        extra = {"attn_mask": causal_lower_right(length, context + length)}
    peers: dict[str, Any] = {}
    for name, backend in (("sdpa_flash", "FLASH_ATTENTION"), ("sdpa_cudnn", "CUDNN_ATTENTION")):
        sdpa_backend = getattr(torch.nn.attention.SDPBackend, backend)

        def call(b: Any = sdpa_backend) -> torch.Tensor:
            with torch.nn.attention.sdpa_kernel(b):
                return torch.nn.functional.scaled_dot_product_attention(
                    qh, case["k"], case["v"], enable_gqa=True, **extra
                )

        try:
            peers[name] = {"out": call()[0].transpose(0, 1),
                           "tflops": case["flops"] / gpu_ms(call) / 1e9}  # fmt: skip
        except Exception as error:  # a backend that refuses the shape
            peers[name] = {"error": f"{type(error).__name__}: {str(error)[:160]}"}
    return peers


# ---- summaries and the machine --------------------------------------------------------------


def time_method(obj: Any, name: str, record: Callable[[float], None]) -> None:
    """Replace `obj.name` by a wrapper that passes the host seconds of each call to `record`."""
    original = getattr(obj, name)

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            record(time.perf_counter() - start)

    setattr(obj, name, timed)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100])."""
    data = sorted(values)
    if not data:
        return float("nan")
    pos = (len(data) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def summary(values: Sequence[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "p90": percentile(values, 90),
        "mean": statistics.fmean(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def machine_info() -> dict[str, Any]:
    cpu_model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass

    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    commit = None
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "torch_version": version("torch"),
        "unified_attn_version": version("unified_attn"),
        "git_commit": commit,
        "gpu": gpu_name(),
    }


def gpu_name() -> str | None:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None
