"""The PNG at the end of a run: decode TB/s per batch and context, decode speedups over the peers,
prefill TFLOP/s per length, and the targets' verdicts as text."""

from __future__ import annotations

import itertools
from typing import Any

from common import pyplot, save_figure

from .config import TARGETS
from .records import best_peer, kfmt
from .run import Run

Shapes = list[dict[str, Any]]


def plot(run: Run) -> bool:
    plt = pyplot(run.console)
    if plt is None:
        return False
    res = run.results
    fig, axes = plt.subplots(2, 2, figsize=(15, 10))
    (ax1, ax2), (ax3, ax4) = axes
    dec = [
        s
        for s in res.get("decode", {}).get("shapes", [])
        if "tb_s" in s.get("uniform", {}).get("ours", {})
    ]
    plot_decode(ax1, dec, run.copy_tb_s)
    plot_decode_speedups(ax2, dec)
    plot_prefill(ax3, [s for s in res.get("prefill", {}).get("shapes", []) if "ours" in s])
    plot_verdicts(ax4, res.get("verdicts", []))
    m = res.get("machine", {})
    fig.suptitle(
        f"unified_attn attention benchmark - {m.get('gpu')}, torch {m.get('torch_version')}, "
        f"triton {m.get('triton_version')} ({res.get('mode')})"
    )
    save_figure(fig, run.png_path, dpi=110)
    return True


def plot_decode(ax: Any, dec: Shapes, copy_tb_s: float | None) -> None:
    for ctx in sorted({s["ctx"] for s in dec}):
        pts = sorted((s["B"], s["uniform"]["ours"]["tb_s"]) for s in dec if s["ctx"] == ctx)
        ax.plot(*zip(*pts, strict=True), marker="o", label=f"ours ctx {kfmt(ctx)}")
        sk = sorted(
            (s["B"], s["skewed"]["ours"]["tb_s"])
            for s in dec
            if s["ctx"] == ctx and "tb_s" in s.get("skewed", {}).get("ours", {})
        )
        if sk:
            ax.plot(
                *zip(*sk, strict=True), marker="x", linestyle=":", color=ax.lines[-1].get_color()
            )
    if copy_tb_s:
        ax.axhline(copy_tb_s, color="black", linestyle="--", label="measured copy")
    ax.axhline(TARGETS["decode_large_tb_s"], color="red", linestyle=":", label="target >= 4 GiB")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch")
    ax.set_ylabel("TB/s of bytes read")
    ax.set_title("Decode, ours (dotted x: skewed lengths)")
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)


def plot_decode_speedups(ax: Any, dec: Shapes) -> None:
    for label, getter, marker in (
        ("SDPA flash", lambda u: best_peer(u, "sdpa_flash"), "o"),
        ("SDPA cuDNN", lambda u: best_peer(u, "sdpa_cudnn"), "s"),
        ("Flex dense", lambda u: u.get("flex_dense"), "^"),
        ("Flex paged", lambda u: u.get("flex_paged"), "D"),
    ):
        pts = [
            (s["kv_gib"], getter(s["uniform"])["ours_speedup"])
            for s in dec
            if getter(s["uniform"]) and "ours_speedup" in getter(s["uniform"])
        ]
        if pts:
            ax.scatter(*zip(*pts, strict=True), marker=marker, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(
        TARGETS["decode_vs_flex_paged"], color="red", linestyle=":", label="target vs flex paged"
    )
    ax.set_xscale("log")
    ax.set_xlabel("KV GiB")
    ax.set_ylabel("peer time / ours")
    ax.set_title("Decode speedup of ours over same-run peers (uniform)")
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)


def plot_prefill(ax: Any, pre: Shapes) -> None:
    for batch, style in zip(sorted({s["B"] for s in pre}), itertools.cycle(("-", "--", ":"))):
        for key, label in (("ours", "ours"), ("sdpa_flash", "SDPA flash"),
                           ("sdpa_cudnn", "SDPA cuDNN"), ("flex", "Flex")):  # fmt: skip
            pts = sorted(
                (s["L"], s[key]["tflop_s"])
                for s in pre
                if s["B"] == batch and "tflop_s" in s.get(key, {})
            )
            if pts:
                ax.plot(
                    *zip(*pts, strict=True), linestyle=style, marker="o", label=f"{label} B={batch}"
                )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("TFLOP/s (causal, visible keys)")
    ax.set_title("Prefill causal")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, alpha=0.3)


def plot_verdicts(ax: Any, verdicts: list[dict[str, Any]]) -> None:
    ax.axis("off")
    lines = ["Targets (this run):"]
    for v in verdicts:
        mark = {True: "MET   ", False: "MISSED", None: "n/a   "}[v["met"]]
        lines.append(f"{mark} {v['name']}: {v['measured']} (bar {v['target']})")
    ax.text(0, 1, "\n".join(wrap(lines, 110)), va="top", family="monospace", fontsize=7)


def wrap(lines: list[str], width: int) -> list[str]:
    """Lines cut at `width` characters, the continuations indented."""
    out = []
    for line in lines:
        while len(line) > width:
            out.append(line[:width])
            line = "    " + line[width:]
        out.append(line)
    return out
