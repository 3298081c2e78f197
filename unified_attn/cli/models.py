"""The `unified-attn models` command: the presets (with their layer kinds), the real-model
shapes `plan` also takes, and the Hugging Face architectures a checkpoint directory may have."""

from __future__ import annotations

import argparse
import json
from typing import Any

from unified_attn.runner.catalog import describe_models, describe_real_shapes


def add_parser(commands: Any) -> None:
    models = commands.add_parser(
        "models",
        help="list the model presets, real-model shapes and supported checkpoint architectures",
        description="What `--model` takes: a preset (run, plan, migrate), a real-model shape "
        "(plan only) or a Hugging Face checkpoint directory of a supported architecture.",
    )
    models.add_argument("--json", action="store_true", help="print the lists as JSON only")
    models.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    report = describe_models() | {"real_shapes": describe_real_shapes()}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_models(report)
    return 0


def print_models(report: dict[str, Any]) -> None:
    from unified_attn.harness.report_console import ReportConsole

    console = ReportConsole()
    console.print(model_table("Presets (run, plan, migrate)", report["presets"]))
    console.print(model_table("Real-model shapes (plan only)", report["real_shapes"]))
    console.print(
        "Checkpoint directories (config.json architectures): " + ", ".join(report["architectures"])
    )


def model_table(title: str, rows: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in ("name", "layers", "layer kinds", "heads / KV heads x head size",
                   "max_position_embeddings"):  # fmt: skip
        table.add_column(column)
    for row in rows:
        table.add_row(row["name"], str(row["layers"]), row["layer_kinds"], row["heads"],
                      f"{row['max_position_embeddings']:,}")  # fmt: skip
    return table
