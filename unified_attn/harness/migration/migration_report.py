"""`print_report`: the migration report as rich tables, one row per generated-token index and
a summary (tolerance, coverage, lines of code, step times, result)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.table import Table


def print_report(report: dict[str, Any]) -> None:
    from unified_attn.harness.report_console import ReportConsole

    console = ReportConsole()
    console.print(steps_table(report))
    console.print(summary_table(report))


def steps_table(report: dict[str, Any]) -> Table:
    from rich.table import Table

    title = (
        f"{report['legacy']['backend']} (legacy, adapter) vs {report['native']['backend']}"
        f" on {report['model']} / {report['device']} {report['dtype']}"
    )
    steps = Table(title=title, title_justify="left")
    for column in ("token", "requests", "max |logit diff|", "token mismatches", "ties", "ok"):
        steps.add_column(column, justify="right")
    for r in report["steps"]:
        steps.add_row(
            str(r["token_index"]),
            str(r["requests"]),
            f"{r['max_abs_logit_diff']:.3g}",
            str(r["token_mismatches"]),
            str(r["ties"]),
            "[green]yes" if r["ok"] else "[red]NO",
        )
    return steps


def summary_table(report: dict[str, Any]) -> Table:
    from rich.table import Table

    summary = Table(show_header=False, title="Summary", title_justify="left")
    cov = report["coverage"]["native"]
    loc = report["lines_of_code"]
    rows = [
        ("atol", f"{report['atol']:g}"),
        ("exercised", ", ".join(f"{k} {v}" for k, v in cov.items())),
        (
            "lines of code",
            f"legacy {loc['legacy']['total']} (4 classes), native "
            f"{loc['native']['total']}, adapter {loc['adapter (shared)']}",
        ),
        (
            "engine step (ms, median)",
            ", ".join(f"{k} {v:.1f}" for k, v in report["engine_step_ms"].items()),
        ),
    ]
    if "host_time" in report:
        host = report["host_time"]
        rows.append(
            (
                "prep_forward (µs)",
                f"legacy {host['legacy']['prep_forward']:.0f}, native "
                f"{host['native']['prep_forward']:.0f} (x{host['prep_forward_ratio']:.2f})",
            )
        )
    rows += [("note", note) for note in report.get("notes", [])]
    rows.append(
        ("result", "[green]PASS" if report["ok"] else "[red]FAIL: " + "; ".join(report["failures"]))
    )
    for key, value in rows:
        summary.add_row(key, value)
    return summary
