"""The `unified-attn migrate` command: `add_parser` registers it, `main` runs it (exit 0 on a
pass, 1 on a mismatch)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from unified_attn.cli.arguments import (
    DTYPES,
    non_negative_float,
    positive_int,
    prepare_cli,
    seed,
    triton_interpreter_on,
)
from unified_attn.harness.migration.migration_report import print_report
from unified_attn.harness.migration.migration_run import run_migration
from unified_attn.harness.migration.migration_workload import SMALL_WORKLOAD


def add_parser(commands: Any) -> None:
    migrate = commands.add_parser(
        "migrate", help="compare a legacy backend (through the adapter) with a native one"
    )
    migrate.add_argument(
        "--legacy", required=True, help="legacy NAME (x means legacy-x) or module:Class"
    )
    migrate.add_argument(
        "--native", required=True, help="NAME or module:Class (see `unified-attn backends`)"
    )
    migrate.add_argument(
        "--model", default="tiny-hybrid", help="preset or checkpoint (see `unified-attn models`)"
    )
    migrate.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    migrate.add_argument("--dtype", default="float32", choices=DTYPES, help="model dtype")
    migrate.add_argument(
        "--atol",
        type=non_negative_float,
        default=None,
        help="logit tolerance (default: 1e-4 for float32)",
    )
    migrate.add_argument("--seed", type=seed, default=0, help="seed of weights and workload")
    migrate.add_argument("--small", action="store_true", help="a 3-request workload")
    migrate.add_argument("--threads", type=positive_int, default=1, help="CPU threads")
    migrate.add_argument("--json", action="store_true", help="print the report as JSON only")
    migrate.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    prepare_cli(args.device, args.threads)
    report = run_migration(
        args.legacy,
        args.native,
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        atol=args.atol,
        seed=args.seed,
        workload=SMALL_WORKLOAD if args.small else None,
    )
    if triton_interpreter_on(args.device):
        report["notes"].append(
            "no GPU, so Triton kernels (if the backends have any) ran in Triton's interpreter"
        )
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print_report(report)
    return 0 if report["ok"] else 1
