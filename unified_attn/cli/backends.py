"""The `unified-attn backends` command: every backend a name selects (the registered ones and
the legacy ports) with its capabilities, and whether it can serve `run`'s default model on this
machine's default device (or `--device`), with the reasons when not."""

from __future__ import annotations

import argparse
import json
from typing import Any

from unified_attn.runner.catalog import default_device, describe_backends
from unified_attn.runner.device import resolve_device
from unified_attn.runner.model_source import DEFAULT_MODEL


def add_parser(commands: Any) -> None:
    backends = commands.add_parser(
        "backends",
        help="list the attention backends, their capabilities and whether they run here",
        description="Every backend `--backend` takes by name, with its device priorities "
        "(higher wins the automatic choice; none: chosen only by name), batch invariance, CUDA "
        f"graphs and layer kinds, and whether it can serve {DEFAULT_MODEL} on the device.",
    )
    backends.add_argument(
        "--device", default=None, help="cpu, cuda or cuda:N (default: cuda when visible, else cpu)"
    )
    backends.add_argument("--json", action="store_true", help="print the list as JSON only")
    backends.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    device = str(resolve_device(args.device or default_device()))
    rows = describe_backends(device)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_backends(rows, device)
    return 0


def priorities(row: dict[str, Any]) -> str:
    return " ".join(f"{d}:{p}" for d, p in row["priority"].items()) or "by name"


def usable(row: dict[str, Any]) -> str:
    if row["reasons"]:
        return "no"
    return "auto" if row["automatic"] else "yes"


def print_backends(rows: list[dict[str, Any]], device: str) -> None:
    from rich import box
    from rich.table import Table

    from unified_attn.harness.report_console import ReportConsole

    first = rows[0] if rows else {"dtype": "?", "head_size": "?"}
    table = Table(
        title=f"Attention backends on {device} ({DEFAULT_MODEL}: head size "
        f"{first['head_size']}, {first['dtype']})",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    table.add_column("name", no_wrap=True)
    for column in ("priority", "layer kinds", "batch\ninvariant", "CUDA\ngraphs", "usable"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["name"], priorities(row), ", ".join(row["layer_kinds"]),
                      yes_no(row["batch_invariant"]), yes_no(row["cuda_graphs"]),
                      usable(row))  # fmt: skip
    console = ReportConsole()
    console.print(table)
    for row in rows:
        if row["reasons"]:
            console.print(f"{row['name']} cannot run here: {'; '.join(row['reasons'])}")
    console.print("usable: auto = chosen when --backend is not given; priority: by name = never "
                  "chosen automatically")  # fmt: skip


def yes_no(value: bool) -> str:
    return "yes" if value else "no"
