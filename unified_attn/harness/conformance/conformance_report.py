"""`print_report`: the conformance report as rich tables, one per attention type (`SECTIONS`),
one row per cell with a mark per contract check (`CHECKS`, `check_mark`), and the verdict."""

from __future__ import annotations

from typing import Any

from unified_attn.harness.conformance.checks import NOT_MEASURABLE
from unified_attn.harness.conformance.state_kinds import STATE_KINDS

CHECKS = ("cache config pure", "in-place output", "rejects bad inputs", "host sync", "allocation")
# fp8 cells only (`fp8.py`): shown after the others when a row has them
FP8_CHECKS = ("fp8 page", "fp8 cache write", "fp8 vs unquantized")
# Row "type" -> the title of its table, in the order the tables are printed.
SECTIONS = {
    "decoder": "decoder self-attention (causal, paged KV cache)",
    "encoder_only": "encoder-only self-attention (bidirectional, no KV cache)",
    "encoder": "encoder self-attention (bidirectional, no KV cache)",
    "encoder_decoder": "cross-attention (encoder keys and values in the KV cache)",
    **{kind: state.title for kind, state in STATE_KINDS.items()},
    "mla": "multi-head latent attention (latent cache, up-projection as a keyword)",
    "batch_invariance": "batch invariance (bitwise: alone, chunked, in batches)",
    "manager": "KV-cache managers in an engine under memory pressure (freed blocks poisoned; "
    "tokens vs ample memory)",
}
COLOUR = {"pass": "green", "fail": "red", "unsupported": "yellow"}


def check_mark(result: str | None) -> str:
    if result is None:
        return " "
    if result == "pass":
        return "[green]✓[/]"
    if result.startswith("fail"):
        return "[red]✗[/]"
    return "-" if result == NOT_MEASURABLE else "[yellow]~[/]"


def counts(rows: list[dict[str, Any]]) -> str:
    """ "3 passed, 1 unsupported": the statuses that occur, in a fixed order."""
    found = {s: sum(r["status"] == s for r in rows) for s in ("pass", "fail", "unsupported")}
    words = {"pass": "passed", "fail": "failed", "unsupported": "unsupported"}
    return ", ".join(f"[{COLOUR[s]}]{n} {words[s]}[/]" for s, n in found.items() if n)


def section_table(title: str, rows: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(title=f"{title}: {counts(rows)}", title_justify="left")
    for column in ("cell", "status", "max err", "checks"):
        table.add_column(column, overflow="fold")
    table.add_column("detail", overflow="fold", ratio=1)  # the rest of the width: folds first
    for r in rows:
        names = CHECKS + (FP8_CHECKS if FP8_CHECKS[0] in r["checks"] else ())
        marks = " ".join(check_mark(r["checks"].get(name)) for name in names)
        notes = [
            f"{k}: {v}"
            for k, v in r["checks"].items()
            if v.endswith("temporaries") or v.startswith("not compared")
        ]
        detail = "; ".join(filter(None, [r.get("detail", ""), *notes]))
        max_err = "" if r["max_err"] is None else f"{r['max_err']:.1e}"
        status = f"[{COLOUR[r['status']]}]{r['status']}"
        table.add_row(r["cell"], status, max_err, marks, detail)
    return table


def print_report(report: dict[str, Any], verbose: bool = False) -> None:
    from unified_attn.harness.report_console import ReportConsole

    console = ReportConsole()
    console.print(
        f"[bold]Conformance of {report['backend']}[/] ({report['class']}) on {report['device']}"
    )
    for kind, title in SECTIONS.items():
        rows = [r for r in report["cells"] if r.get("type", "decoder") == kind]
        if rows:
            console.print(section_table(title, rows))
    console.print(
        "checks: " + " / ".join(CHECKS) + " (fp8 cells add " + " / ".join(FP8_CHECKS) + "; "
        "✓ pass, ✗ fail, - not measurable on CPU, ~ see detail)"
    )
    if report.get("triton_interpreter"):
        console.print(
            "note: no GPU, so Triton kernels (if the backend has any) ran in Triton's interpreter"
        )
    for row in report["cells"] if verbose else ():
        if "trace" in row:
            console.print(f"{row['cell']}:", style="bold", markup=False)
            console.print(row["trace"], markup=False, highlight=False)
    verdict = "[green]PASS" if report["ok"] else "[red]FAIL"
    console.print(
        f"{verdict}[/]: {report['passed']} passed, {report['failed']} failed, "
        f"{report['unsupported']} unsupported"
    )
