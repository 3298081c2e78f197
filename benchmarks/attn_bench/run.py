"""The record of one benchmark run: its arguments and parameters, the time budget shared by the
sections, the seeded random sources, the progress log, and the results with their JSON file."""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from pathlib import Path
from typing import Any

import torch
from common import output_dir, write_json
from rich.console import Console

from .config import SECTIONS, SEED


class Interrupted(BaseException):
    """Raised by the SIGTERM handler so that partial results are still written (a
    BaseException, so that the per-peer `except Exception` handlers let it through)."""


class Run:
    def __init__(self, args: argparse.Namespace, params: dict[str, Any], console: Console):
        self.args = args
        self.params = params
        self.console = console
        self.t0 = time.perf_counter()
        self.budget = float(args.budget_s if args.budget_s is not None else params["budget_s"])
        self.sections = args.sections
        self.dev = torch.device("cuda")
        self.rng = random.Random(SEED)
        self.gen = torch.Generator().manual_seed(SEED)
        self.out_dir = output_dir(args)
        self.json_path = self.out_dir / "attention.json"
        self.png_path = self.out_dir / "attention.png"
        self.copy_tb_s: float | None = None
        self.results: dict[str, Any] = {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left_for(self, section: str) -> float:
        """Seconds this section may still spend, keeping the reserve of the later sections."""
        later = SECTIONS[SECTIONS.index(section) + 1 :]
        reserve = sum(self.params["reserve_s"][s] for s in later if s in self.sections)
        return self.budget - self.elapsed() - reserve

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {msg}", flush=True)

    def save(self) -> None:
        self.results["elapsed_s"] = self.elapsed()
        write_json(self.json_path, self.results, default=json_default)


def json_default(obj: Any) -> Any:
    if isinstance(obj, (torch.dtype, torch.device, Path)):
        return str(obj)
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    raise TypeError(f"not JSON serialisable: {type(obj)}")


def err_str(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:800]
