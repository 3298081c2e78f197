"""`model_step.py`'s tables (one per configuration, then the TP speedups) and its plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import pyplot, save_figure, table
from rich.console import Console


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_config(console: Console, config: dict[str, Any]) -> None:
    name = f"{config['model']}, tp={config['tp']}"
    if "error" in config:
        console.print(f"[red]{name}: {config['error']}[/red]")
        return
    c = config["ceilings"]
    console.print(
        f"{name}: {config['rank_weights']['bytes'] / 1e9:.2f} GB of weights per rank, copy "
        f"{c['copy_bytes_per_s'] / 1e12:.2f} TB/s, matmul {c['matmul_flops_per_s'] / 1e12:.0f} "
        f"TFLOP/s, CUDA graphs {'on' if config['cuda_graphs'] else 'off'}"
    )
    console.print(_decode_table(name, config["decode"]))
    if config.get("decode_plain_steps"):
        console.print(_decode_table(f"{name}, plain steps", config["decode_plain_steps"]))
    console.print(_prefill_table(name, config["prefill"]))


def _decode_table(name: str, rows: list[dict[str, Any]]) -> Any:
    out = table(f"decode, {name}",
                ["batch", "overlap", "context", "wall ms", "device ms", "host ms", "tokens/s",
                 "roofline ms", "bound", "of roofline (wall)", "(device)", "vs TP=1"])  # fmt: skip
    for r in rows:
        out.add_row(
            str(r["batch"]), "on" if r.get("overlap") else "off", f"{r['mean_context']:.0f}",
            f"{r['wall_step_ms']:.3f}",
            _num(r["device_step_ms"], ".3f"), _num(r["host_overhead_ms"], ".3f"),
            f"{r['tokens_per_s']:,.0f}", f"{r['roofline_ms']:.3f}", r["roofline_bound"],
            f"{r['roofline_fraction']:.1%}", _num(r["device_roofline_fraction"], ".1%"),
            _num(r.get("tp_speedup"), ".2f"),
        )  # fmt: skip
    return out


def _prefill_table(name: str, rows: list[dict[str, Any]]) -> Any:
    out = table(f"prefill (one request per step), {name}",
                ["tokens", "step ms", "tokens/s", "TFLOP/s per rank", "of matmul"])  # fmt: skip
    for r in rows:
        out.add_row(str(r["tokens"]), f"{r['step_ms']:.2f}", f"{r['tokens_per_s']:,.0f}",
                    f"{r['tflops']:.3g}", f"{r['matmul_fraction']:.1%}")  # fmt: skip
    return out


def print_speedups(console: Console, report: dict[str, Any]) -> None:
    for model, sizes in report["tp_speedup"].items():
        for size, per_batch in sizes.items():
            text = ", ".join(f"{v:.2f}x at batch {b}" for b, v in per_batch.items())
            console.print(f"{model} {size} decode tokens/s over tp1: {text}")


def _measured(report: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Configurations with results, by model."""
    by_model: dict[str, list[dict[str, Any]]] = {}
    for config in report["configs"]:
        if "decode" in config:
            by_model.setdefault(config["model"], []).append(config)
    return by_model


def plot(report: dict[str, Any], path: Path, console: Console) -> None:
    """Per model: the fraction of the roofline per batch and TP (wall solid, device dashed),
    and the TP speedups per batch."""
    by_model = _measured(report)
    plt = pyplot(console)
    if plt is None or not by_model:
        return
    fig, axes = plt.subplots(2, len(by_model), figsize=(5 * len(by_model), 7), squeeze=False)
    for col, (model, configs) in enumerate(by_model.items()):
        top, bottom = axes[0][col], axes[1][col]
        for config in sorted(configs, key=lambda c: c["tp"]):
            rows = config["decode"]
            batches = [r["batch"] for r in rows]
            line = top.plot(batches, [r["roofline_fraction"] for r in rows], "o-",
                            label=f"tp={config['tp']} wall")[0]  # fmt: skip
            device = [(r["batch"], r["device_roofline_fraction"]) for r in rows
                      if r["device_roofline_fraction"] is not None]  # fmt: skip
            if device:
                top.plot(*zip(*device, strict=True), "s--", color=line.get_color(),
                         label=f"tp={config['tp']} device")  # fmt: skip
            speedup = [(r["batch"], r["tp_speedup"]) for r in rows if r.get("tp_speedup")]
            if config["tp"] > 1 and speedup:
                bottom.plot(*zip(*speedup, strict=True), "o-", label=f"tp={config['tp']}")
        _axes(top, f"{model}: fraction of the roofline", "roofline / step")
        bottom.axhline(1.0, color="gray", linewidth=0.8)
        _axes(bottom, f"{model}: decode tokens/s over tp=1", "speedup")
    save_figure(fig, path, dpi=120)


def _axes(ax: Any, title: str, ylabel: str) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode batch")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.set_ylim(bottom=0)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
