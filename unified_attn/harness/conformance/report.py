"""`print_report`: the conformance report as a rich table, one row per cell with a mark per
contract check (`CHECKS`, `check_mark`), and the verdict."""

from __future__ import annotations

from typing import Any

from unified_attn.harness.conformance.checks import NOT_MEASURABLE

CHECKS = ("cache config pure", "in-place output", "rejects bad inputs", "host sync", "allocation")


def check_mark(result: str | None) -> str:
    if result is None:
        return " "
    if result == "pass":
        return "[green]✓[/]"
    if result.startswith("fail"):
        return "[red]✗[/]"
    return "-" if result == NOT_MEASURABLE else "[yellow]~[/]"


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"Conformance of {report['backend']} ({report['class']}) on {report['device']}",
        title_justify="left",
        caption="checks: " + " / ".join(CHECKS) + " (✓ pass, ✗ fail, - not "
        "measurable on CPU, ~ see detail)",
        caption_justify="left",
    )
    for column in ("cell", "status", "max err", "checks", "detail"):
        table.add_column(column, overflow="fold")
    colour = {"pass": "green", "fail": "red", "unsupported": "yellow"}
    for r in report["cells"]:
        marks = " ".join(check_mark(r["checks"].get(name)) for name in CHECKS)
        notes = [f"{k}: {v}" for k, v in r["checks"].items() if v.endswith("temporaries")]
        detail = "; ".join(filter(None, [r.get("detail", ""), *notes]))
        max_err = "" if r["max_err"] is None else f"{r['max_err']:.1e}"
        table.add_row(r["cell"], f"[{colour[r['status']]}]{r['status']}", max_err, marks, detail)
    console = Console()
    console.print(table)
    verdict = "[green]PASS" if report["ok"] else "[red]FAIL"
    console.print(
        f"{verdict}[/]: {report['passed']} passed, {report['failed']} failed, "
        f"{report['unsupported']} unsupported"
    )
