"""The `unified-attn` command: `build_parser` (one subcommand per module of this package: `run`,
`plan`, `check`, `migrate`, `backends`, `models`; `arguments` holds the shared argument types)
and `main`, the console script. The harness is the library these commands drive.

Every `--help` shows the defaults; bad input (a usage error or a `ValueError` from the run) is
one line on stderr and exit code 2, Ctrl-C one "interrupted" line and exit code 130, never a
traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Any, NoReturn

from unified_attn.cli.arguments import join_negative_values, use_interpreter_without_gpu

PROG = "unified-attn"
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report Ctrl-C


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows `(default: X)` where there is a default to show (not for None or flags)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class CommandParser(argparse.ArgumentParser):
    """An `ArgumentParser` whose help shows defaults and whose usage errors are one line."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    use_interpreter_without_gpu()  # before the commands import the kernels
    from unified_attn.cli import backends, check, migrate, models, plan, run

    parser = CommandParser(prog=PROG, description="The `unified-attn` command.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=CommandParser
    )
    for command in (run, migrate, check, plan, backends, models):
        command.add_parser(commands)
    return parser


def version() -> str:
    try:
        return metadata.version("unified_attn")
    except metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0: done or passed; 1: a migrate or check mismatch or failure; 2: bad input;
    130: interrupted."""
    try:
        given = list(sys.argv[1:] if argv is None else argv)
        args = build_parser().parse_args(join_negative_values(given))
    except SystemExit as stop:  # --help, --version, or a usage error already printed
        return stop.code if isinstance(stop.code, int) else 0
    return run_command(args)


def run_command(args: argparse.Namespace) -> int:
    where = f"{PROG} {args.command}"
    try:
        return int(args.handler(args))
    except KeyboardInterrupt:
        print(f"{where}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ValueError, FileNotFoundError) as error:
        print(f"{where}: error: {one_line(str(error))}", file=sys.stderr)
        return EXIT_BAD_INPUT


def one_line(message: str) -> str:
    """A multi-line message (a list of reasons) as one line: `a:\n  b\n  c` -> `a: b; c`."""
    text = ""
    for line in (part.strip() for part in message.splitlines()):
        if line:
            text += (" " if not text or text.endswith(":") else "; ") + line
    return text.strip()
