"""The `unified-attn check` command: `add_parser` registers it, `main` runs it (exit 0 on a
pass, 1 on a failure)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from unified_attn.harness.conformance.prepare import prepare_cli
from unified_attn.harness.conformance.report import print_report
from unified_attn.harness.conformance.run import run_conformance


def add_parser(commands: Any) -> None:
    check = commands.add_parser("check", help="run a backend through the conformance suite")
    check.add_argument("backend", help="backend NAME or module:Class (legacy classes are wrapped)")
    check.add_argument("--device", default="cpu")
    check.add_argument("--seed", type=int, default=0)
    check.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    check.add_argument("--json", action="store_true", help="print the report as JSON only")
    check.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    prepare_cli(args.device, args.threads)
    report = run_conformance(args.backend, args.device, seed=args.seed)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0 if report["ok"] else 1
