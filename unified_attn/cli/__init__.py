"""The `unified-attn` command: `build_parser` (one subcommand per module: `run` in this package,
`migrate`, `check` and `plan` in the harness) and `main`, the console script."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from unified_attn.cli import run
from unified_attn.harness import plan
from unified_attn.harness.conformance import command as check
from unified_attn.harness.migration import command as migrate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="unified-attn", description="The `unified-attn` command.")
    commands = parser.add_subparsers(dest="command", required=True)
    for command in (run, migrate, check, plan):
        command.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0: done or passed; 1: a migrate or check mismatch or failure; 2: a bad argument."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except ValueError as error:
        print(f"unified-attn: error: {error}", file=sys.stderr)
        return 2
