"""`prepare_cli`: the process set-up shared by the command-line runs (`check`, `migrate` and the
benchmarks): the import path, the Triton interpreter on CPU and the CPU thread count."""

from __future__ import annotations

import os
import sys

import torch


def prepare_cli(device: str, threads: int) -> None:
    """Command-line runs: `module:Class` resolves from the working directory too; on CPU the
    Triton kernels run in the interpreter (TRITON_INTERPRET is read when the kernels are first
    imported, so before any backend is resolved) with `threads` intra-op threads (tiny shapes
    run fastest on one; more threads mostly add contention)."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if torch.device(device).type != "cpu":
        return
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(threads)
