"""What the command-line runs share (`check`, `migrate`, `run`, `plan` and the benchmarks): the
process set-up (`prepare_cli`: the device checked, the import path, the Triton interpreter on
CPU, the CPU thread count) and the argument types (`positive_int`, `memory_size`, `DTYPES`,
`kv_cache_dtype`), so bad values are refused with one message naming the option, the expected
and the found value."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from unified_attn.runner.device import resolve_device
from unified_attn.runner.memory import parse_memory
from unified_attn.tensor_specs.paged import kv_cache_dtype_name

DTYPES = ("float32", "float16", "bfloat16")


def prepare_cli(device: str, threads: int) -> None:
    """Command-line runs: the device is checked first (one clear error for a device this
    machine lacks); `module:Class` resolves from the working directory too; on CPU the Triton
    kernels run in the interpreter (TRITON_INTERPRET is read when the kernels are first
    imported, so before any backend is resolved) with `threads` intra-op threads (tiny shapes
    run fastest on one; more threads mostly add contention)."""
    if threads <= 0:
        raise ValueError(f"threads must be a positive int, got {threads}; give 1 or more")
    on_cpu = resolve_device(device).type == "cpu"
    add_cwd_to_path()
    if not on_cpu:
        return
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(threads)


def add_cwd_to_path() -> None:
    """`module:Class` backends resolve from the working directory, as `python -m` would."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer, got {text!r}; give e.g. 1"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer, got {value}; give 1 or more"
        )
    return value


def memory_size(text: str) -> int:
    """argparse type: a memory size (`parse_memory`) in bytes."""
    try:
        return parse_memory(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def kv_cache_dtype(text: str) -> str:
    """argparse type: an engine's `kv_cache_dtype`, `auto` or `fp8` (`fp8_e4m3`)."""
    try:
        kv_cache_dtype_name(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text
