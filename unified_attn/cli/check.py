"""The `unified-attn check` command: `add_parser` registers it, `main` runs it (exit 0 on a
pass, 1 on a failure)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from unified_attn.cli.arguments import positive_int, prepare_cli, seed, triton_interpreter_on
from unified_attn.harness.conformance.conformance_report import print_report
from unified_attn.harness.conformance.conformance_run import run_conformance
from unified_attn.harness.conformance.state_kinds import STATE_KINDS
from unified_attn.selector import resolve_backend


def add_parser(commands: Any) -> None:
    check = commands.add_parser(
        "check",
        help="run a backend through the conformance suite",
        description="Run a backend through the conformance suite: decoder, encoder, "
        "encoder-only and cross-attention cells (a type the backend does not declare is "
        "reported unsupported, with its reasons), or the state cells of a recurrent-state "
        f"backend ({', '.join(STATE_KINDS)}: prefill, chunked prefill, decode, prefix hits on "
        "checkpoints, drafts rejected, preemption).",
    )
    check.add_argument(
        "backend",
        help="registered name, legacy-reference / legacy-triton, or module:Class of a native or "
        "a four-class backend (wrapped in LegacyBackendAdapter); see `unified-attn backends`",
    )
    check.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    check.add_argument("--seed", type=seed, default=0, help="seed of the inputs")
    check.add_argument("--threads", type=positive_int, default=1, help="CPU threads")
    check.add_argument("--json", action="store_true", help="print the report as JSON only")
    check.add_argument(
        "--verbose", action="store_true", help="print the traceback of every cell that crashed"
    )
    check.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    prepare_cli(args.device, args.threads)  # refuses a device this machine lacks, first
    report = run_conformance(resolve_backend(args.backend), args.device, seed=args.seed)
    report["triton_interpreter"] = triton_interpreter_on(args.device)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report, verbose=args.verbose)
    return 0 if report["ok"] else 1
