"""`decode_fixed_cost.py`'s report: the rich table, the PNG, the comparison with an earlier
run (`--baseline`) and the host-time split table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common import pyplot, save_figure, table

SLOWER = 1.05  # ours now / ours in the baseline above this: slower (run-to-run noise below)


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(console: Any, results: dict[str, Any]) -> None:
    t = table("paged decode per call (us; vLLM/ours > 1: ours faster)",
              ["B", "ctx", "split", "ours eager", "vLLM eager", "ratio", "ours submit",
               "ours graph", "vLLM graph", "ratio", "ours TB/s", "vLLM TB/s", "vLLM path",
               "ours-ref", "vLLM-ref", "ours-vLLM"])  # fmt: skip
    for r in results["shapes"]:
        o, v, d = r["ours"], r.get("vllm", {}), r["diff"]
        split = r["split"]["num_segments"] if r["split"] else "-"
        err = {k: fmt(d[k]["max_abs_err"], ".1e") if k in d else "-" for k in
               ("ours_vs_ref", "vllm_vs_ref", "ours_vs_vllm")}  # fmt: skip
        t.add_row(str(r["batch"]), str(r["ctx"]), str(split), fmt(o["eager_us"]),
                  fmt(v.get("eager_us")), fmt(r.get("vllm_over_ours_eager"), ".2f"),
                  fmt(o["host_submit_us"]), fmt(o.get("graph_us")), fmt(v.get("graph_us")),
                  fmt(r.get("vllm_over_ours_graph"), ".2f"), fmt(o.get("graph_tb_s"), ".2f"),
                  fmt(v.get("graph_tb_s"), ".2f"), r.get("vllm_info", {}).get("path", "-"),
                  *err.values())  # fmt: skip
    console.print(t)
    if results.get("copy_tb_s"):
        console.print(f"copy bandwidth (same run): {results['copy_tb_s']:.2f} TB/s")
    console.print(f"verdict: {results['verdict']}")
    if "host_profile" in results:
        print_host_profile(console, results["host_profile"])
    for error in results["errors"]:
        console.print(f"[red]{error}[/]")


def print_host_profile(console: Any, prof: dict[str, Any]) -> None:
    t = table(f"our host time per call, B {prof['batch']} ctx {prof['ctx']} (us, median)",
              ["piece", "median", "p90", "note"], justify="left")  # fmt: skip
    for name, rec in prof["pieces"].items():
        t.add_row(name, fmt(rec.get("median_us"), ".2f"), fmt(rec.get("p90_us"), ".2f"),
                  rec.get("note", rec.get("error", "")))  # fmt: skip
    console.print(t)
    console.print(f"derived: {prof['derived']}")


def verdict(rows: list[dict[str, Any]], on_gpu: bool, target: dict[str, Any]) -> dict[str, Any]:
    """The issue's target: ours <= 75 us per eager call at batch 1 / 4k (None: not measured)."""
    row = next((r for r in rows if (r["batch"], r["ctx"]) == (target["batch"], target["ctx"])),
               None)  # fmt: skip
    ours = None if row is None or not on_gpu else row["ours"]["eager_us"]
    return {"target": f"ours <= {target['eager_us']} us per eager call at batch "
                      f"{target['batch']} / ctx {target['ctx']}",
            "ours_eager_us": ours,
            "vllm_eager_us": None if ours is None or "vllm" not in row else row["vllm"]["eager_us"],
            "met": None if ours is None else ours <= target["eager_us"]}  # fmt: skip


def baseline_check(rows: list[dict[str, Any]], path: str) -> dict[str, Any]:
    """Ours now / ours in an earlier run of this script, per shape both ran (> 1: slower)."""
    old = {(r["batch"], r["ctx"]): r for r in json.loads(Path(path).read_text())["shapes"]}
    out: dict[str, Any] = {"path": path, "shapes": [], "slower": []}
    for r in rows:
        prev = old.get((r["batch"], r["ctx"]))
        if prev is None:
            continue
        entry = {"batch": r["batch"], "ctx": r["ctx"]}
        for key in ("eager_us", "graph_us"):
            if key in r["ours"] and key in prev["ours"]:
                entry[f"{key[:-3]}_now_over_then"] = r["ours"][key] / prev["ours"][key]
        out["shapes"].append(entry)
        if any(v > SLOWER for k, v in entry.items() if k.endswith("_then")):
            out["slower"].append(entry)
    out["no_shape_slower"] = not out["slower"]
    return out


def plot(results: dict[str, Any], path: Path, console: Any) -> Path | None:
    rows = results["shapes"]
    plt = pyplot(console) if rows else None
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    contexts = sorted({r["ctx"] for r in rows})
    panels = ((axes[0], "eager_us", "eager wall per call (host included)"),
              (axes[1], "graph_us", "CUDA-graph replay per call (device)"))  # fmt: skip
    for ax, key, title in panels:
        for ctx in contexts:
            sel = [r for r in rows if r["ctx"] == ctx and key in r["ours"]]
            if not sel:
                continue
            batches = [r["batch"] for r in sel]
            line = ax.plot(batches, [r["ours"][key] for r in sel], "o-", label=f"ours {ctx}")
            if all("vllm" in r for r in sel):
                ax.plot(batches, [r["vllm"][key] for r in sel], "x--",
                        color=line[0].get_color(), label=f"vLLM {ctx}")  # fmt: skip
        ax.set(xscale="log", yscale="log", xlabel="decode batch", ylabel="us", title=title)
        ax.legend(fontsize=7)
    axes[0].axhline(75.0, color="grey", lw=0.8)  # the batch-1 / 4k target
    labels, eager, graph = [], [], []
    for r in rows:
        if "vllm_over_ours_eager" in r:
            labels.append(f"B{r['batch']} {r['ctx']}")
            eager.append(r["vllm_over_ours_eager"])
            graph.append(r.get("vllm_over_ours_graph", float("nan")))
    ys = range(len(labels))
    axes[2].barh([y - 0.2 for y in ys], eager, height=0.4, label="eager")
    axes[2].barh([y + 0.2 for y in ys], graph, height=0.4, label="graph")
    axes[2].set_yticks(list(ys), labels, fontsize=7)
    axes[2].axvline(1.0, color="grey", lw=0.8)
    axes[2].set(xlabel="vLLM time / our time (> 1: ours faster)", title="same-run ratios")
    axes[2].legend(fontsize=7)
    save_figure(fig, path, dpi=120)
    return path
