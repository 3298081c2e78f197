"""The text report at the end of a run: the machine and its ceilings, the decode and prefill
tables, the targets' verdicts and the errors."""

from __future__ import annotations

from typing import Any

from common import status_markup, table
from rich.markup import escape
from rich.table import Table

from .config import TARGETS
from .records import best_peer, fmt_peer
from .run import Run

DECODE_COLUMNS = (
    "B", "ctx", "KV GiB", "ours us", "TB/s", "% copy", "skewed", "flash", "cudnn", "flex",
    "flex paged", "x flash", "x paged", "target",
)  # fmt: skip
PREFILL_COLUMNS = (
    "B", "L", "ours", "flash", "cudnn", "flex", "x flash (>=1.2)", "x cudnn (>=0.9)", "x flex",
    "err vs flash",
)  # fmt: skip


def print_report(run: Run) -> None:
    res = run.results
    con = run.console
    m = res.get("machine", {})
    con.print(
        f"[bold]Attention benchmark[/bold] ({res.get('mode')}) - {m.get('gpu')}, torch "
        f"{m.get('torch_version')}, triton {m.get('triton_version')}, "
        f"{res.get('elapsed_s', 0):.0f} s"
    )
    ceil = res.get("ceilings", {})
    if "copy" in ceil:
        con.print(
            f"Ceilings: copy {ceil['copy']['tb_s']:.2f} TB/s (read + write), bf16 matmul 8192^3 "
            f"{ceil['matmul_bf16_8192']['tflop_s']:.0f} TFLOP/s"
        )
    dec = sorted(res.get("decode", {}).get("shapes", []), key=lambda s: (s["B"], s["ctx"]))
    if dec:
        con.print(decode_table(dec))
    pre = res.get("prefill", {}).get("shapes", [])
    if pre:
        con.print(prefill_table(pre))
    ver = res.get("verdicts", [])
    if ver:
        con.print(verdict_table(ver))
    if res.get("errors"):
        con.print(f"[red]Errors:[/red] {escape(str(res['errors']))}")


def decode_table(shapes: list[dict[str, Any]]) -> Table:
    t = table(
        "Decode, 32q/8kv/d128 bf16, page 16: TB/s of bytes read (peers: same bytes / their time); "
        "x = peer time / ours",
        DECODE_COLUMNS,
    )
    for s in shapes:
        if "uniform" not in s or "tb_s" not in s["uniform"]["ours"]:
            t.add_row(str(s["B"]), str(s["ctx"]), *["-"] * 11, "error")
            continue
        u = s["uniform"]
        o = u["ours"]
        fl = best_peer(u, "sdpa_flash")
        fp = u.get("flex_paged")
        t.add_row(
            str(s["B"]),
            str(s["ctx"]),
            f"{s['kv_gib']:.2f}",
            f"{o['ms'] * 1e3:.1f}",
            f"{o['tb_s']:.2f}",
            f"{o.get('pct_of_copy', float('nan')):.0f}",
            fmt_peer(s.get("skewed", {}).get("ours")),
            fmt_peer(fl),
            fmt_peer(best_peer(u, "sdpa_cudnn")),
            fmt_peer(u.get("flex_dense")),
            fmt_peer(fp),
            f"{fl['ours_speedup']:.2f}" if fl and "ours_speedup" in fl else "-",
            f"{fp['ours_speedup']:.2f}" if fp and "ours_speedup" in fp else "-",
            decode_target(s, o["tb_s"]),
        )
    return t


def decode_target(s: dict[str, Any], tb_s: float) -> str:
    """The bar that applies to a decode shape and its status, or "" if none does."""
    if s["kv_gib"] >= TARGETS["decode_large_min_kv_gib"]:
        return f">=3.0 {status_markup(tb_s >= TARGETS['decode_large_tb_s'])}"
    if s["B"] in (16, 32) and s["ctx"] == 8192:
        return f">=2.7 {status_markup(tb_s >= TARGETS['decode_mid_tb_s'])}"
    if s["B"] == 1 and s["ctx"] == 32768:
        return f">=1.5 {status_markup(tb_s >= TARGETS['decode_b1_32k_tb_s'])}"
    return ""


def prefill_table(shapes: list[dict[str, Any]]) -> Table:
    t = table("Prefill causal, 32q/8kv/d128 bf16: TFLOP/s (visible keys only)", PREFILL_COLUMNS)
    for s in shapes:
        if "ours" not in s:
            t.add_row(str(s["B"]), str(s["L"]), *["-"] * 7, "error")
            continue
        err = s.get("sdpa_flash", {}).get("vs_ours", {}).get("max_rel_err")
        t.add_row(
            str(s["B"]),
            str(s["L"]),
            fmt_peer(s["ours"], "tflop_s"),
            fmt_peer(s.get("sdpa_flash"), "tflop_s"),
            fmt_peer(s.get("sdpa_cudnn"), "tflop_s"),
            fmt_peer(s.get("flex"), "tflop_s"),
            speedup(s, "sdpa_flash"),
            speedup(s, "sdpa_cudnn"),
            speedup(s, "flex"),
            f"{err:.1e}" if err is not None else "-",
        )
    return t


def speedup(s: dict[str, Any], key: str) -> str:
    r = s.get(key, {})
    return f"{r['ours_speedup']:.2f}" if "ours_speedup" in r else "-"


def verdict_table(verdicts: list[dict[str, Any]]) -> Table:
    t = table(
        "Targets (KERNELS_AND_BENCHMARKS.md), all from this run",
        ("target", "bar", "measured", "status"),
        justify="left",
    )
    for v in verdicts:
        t.add_row(
            escape(v["name"]), escape(v["target"]), escape(v["measured"]), status_markup(v["met"])
        )
    return t
