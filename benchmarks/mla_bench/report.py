"""Report: verdicts, the table, the per-shape progress line and the plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import make_console, pyplot, save_figure, table

from mla_bench.config import TARGET_TB_S, TOLERANCE


def verdicts(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The TB/s target (a bf16 latent cache's: not judged with --fp8) and the output checks."""
    out = []
    bf16_cache = not results["params"].get("fp8")
    for s in results["shapes"]:
        at_target = (s["heads"], s["batch"], s["ctx"]) == (128, 64, 8192)
        if bf16_cache and at_target and "tb_s" in s["best"]:
            out.append(
                {
                    "name": "MLA decode, H 128, B 64, ctx 8k, latent bytes",
                    "target": f">= {TARGET_TB_S} TB/s",
                    "measured": s["best"]["tb_s"],
                    "met": s["best"]["tb_s"] >= TARGET_TB_S,
                }
            )
    checks = [results["oracle_check"]] + [
        s[k]["vs_ours"]
        for s in results["shapes"]
        for k in ("gather_sdpa", "sdpa_dense")
        if "vs_ours" in s.get(k, {})
    ]
    bad = sum(not c["ok"] for c in checks)
    out.append(
        {
            "name": "outputs vs oracle and peers",
            "target": f"rel err <= {TOLERANCE}",
            "measured": f"{len(checks) - bad}/{len(checks)} ok",
            "met": bad == 0,
        }
    )
    return out


def fmt(rec: dict[str, Any], key: str, spec: str = ".2f") -> str:
    return format(rec[key], spec) if key in rec else rec.get("error", "-")[:30]


def print_table(results: dict[str, Any]) -> None:
    cols = [
        "H",
        "B",
        "ctx",
        "split",
        "ours us",
        "TB/s",
        "% copy",
        "TFLOP/s",
        "gather+SDPA us",
        "x",
        "SDPA dense us",
        "x",
    ]
    t = table("MLA decode (latent bytes)", cols)
    for s in results["shapes"]:
        b, g, d = s["best"], s.get("gather_sdpa", {}), s.get("sdpa_dense", {})
        us = {
            k: f"{r['ms'] * 1e3:.1f}" if "ms" in r else "-"
            for k, r in (("b", b), ("g", g), ("d", d))
        }
        t.add_row(
            str(s["heads"]),
            str(s["batch"]),
            str(s["ctx"]),
            str(b.get("num_segments")),
            us["b"],
            fmt(b, "tb_s"),
            fmt(b, "pct_of_copy", ".0f"),
            fmt(b, "tflop_s", ".0f"),
            us["g"],
            fmt(g, "ours_speedup"),
            us["d"],
            fmt(d, "ours_speedup"),
        )
    console = make_console(160)
    console.print(t)
    for v in results["verdicts"]:
        console.print(
            f"{v['name']}: {v['measured']} (target {v['target']}): "
            f"{'met' if v['met'] else 'missed'}"
        )


def plot(results: dict[str, Any], path: Path) -> bool:
    plt = pyplot(make_console(120))
    if plt is None:
        return False
    heads = sorted({s["heads"] for s in results["shapes"]}, reverse=True)
    fig, axes = plt.subplots(1, len(heads), figsize=(7 * len(heads), 5), squeeze=False)
    copy = results["ceilings"]["copy"]["tb_s"]
    for ax, h in zip(axes[0], heads, strict=True):
        shapes = [s for s in results["shapes"] if s["heads"] == h]
        for ctx in sorted({s["ctx"] for s in shapes}):
            for key, style in (("best", "-o"), ("gather_sdpa", ":x")):
                pts = sorted(
                    (s["batch"], s[key]["tb_s"])
                    for s in shapes
                    if s["ctx"] == ctx and "tb_s" in s.get(key, {})
                )
                if pts:
                    label = f"{'ours' if key == 'best' else 'gather+SDPA'} ctx {ctx}"
                    ax.plot(*zip(*pts, strict=True), style, label=label)
        ax.axhline(copy, color="black", linestyle="--", label="measured copy")
        if h == 128 and not results["params"].get("fp8"):
            ax.axhline(TARGET_TB_S, color="red", linestyle=":", label="target (B 64, 8k)")
        ax.set(
            xscale="log", xlabel="batch", ylabel="TB/s of latent bytes", title=f"MLA decode, H {h}"
        )
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
    m = results["machine"]
    fig.suptitle(f"MLA decode - {m.get('gpu', m.get('cpu_model'))} ({results['mode']})")
    save_figure(fig, path, dpi=110)
    return True


def shape_line(rec: dict[str, Any]) -> str:
    b = rec["best"]
    peer = rec.get("gather_sdpa", {})
    return (
        f"H={rec['heads']} B={rec['batch']} ctx={rec['ctx']}: tiles {b.get('tiles')} "
        f"segments {b.get('num_segments')}: {b.get('ms', float('nan')) * 1e3:.1f} us, "
        f"{b.get('tb_s', float('nan')):.2f} TB/s, {b.get('tflop_s', float('nan')):.0f} TFLOP/s;"
        f" gather+SDPA {peer.get('ms', float('nan')) * 1e3:.1f} us"
    )
