"""What the command-line runs share (`check`, `migrate`, `run`, `plan` and the benchmarks): the
process set-up (`prepare_cli`: the device checked, the import path, the Triton interpreter on
CPU, the CPU thread count) and the argument types (`positive_int`, `memory_size`, `DTYPES`,
`kv_cache_dtype`), so bad values are refused with one message naming the option, the expected
and the found value."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from unified_attn.runner.device import resolve_device
from unified_attn.runner.memory import parse_memory
from unified_attn.sampling_params import MAX_SEED
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


def use_interpreter_without_gpu() -> None:
    """On a machine without CUDA, Triton's kernels run in its interpreter (unless the user set
    TRITON_INTERPRET): a kernel decides when it is imported, so this runs before the commands
    import any."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def triton_interpreter_on(device: str) -> bool:
    """Whether Triton kernels on `device` run in Triton's interpreter (what reports say)."""
    on_cpu = resolve_device(device).type == "cpu"
    return on_cpu and os.environ.get("TRITON_INTERPRET") == "1"


def add_cwd_to_path() -> None:
    """`module:Class` backends resolve from the working directory, as `python -m` would."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def number_type(
    convert: Callable[[str], Any], valid: Callable[[Any], bool], expected: str, example: str
) -> Callable[[str], Any]:
    """An argparse type: `convert(text)` (int, float), refused unless `valid`, with one message
    naming what was expected, what was found and an example."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            shown = repr(text if len(text) <= 24 else text[:21] + "...")
        else:
            if valid(value):
                return value
            shown = str(value) if len(str(value)) <= 24 else repr(text[:21] + "...")
        raise argparse.ArgumentTypeError(f"expected {expected}, got {shown}; give e.g. {example}")

    return parse


positive_int = number_type(int, lambda v: v > 0, "a positive integer", "1")
non_negative_float = number_type(
    float, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0", "0.8"
)
seed = number_type(int, lambda v: 0 <= v <= MAX_SEED, f"an int in [0, {MAX_SEED}]", "0")


def text_value(text: str) -> str:
    """argparse type: a non-empty string."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a non-empty value, got ''")
    return text


def join_negative_values(argv: list[str]) -> list[str]:
    """`--option -5GiB` as `--option=-5GiB`: argparse reads a value that starts with '-' and a
    digit as an option of its own ("expected one argument"); joined, the option's own check
    refuses it by name."""
    out: list[str] = []
    for arg in argv:
        previous = out[-1] if out else ""
        if (
            previous.startswith("--") and "=" not in previous
            and len(arg) > 1 and arg[0] == "-" and (arg[1].isdigit() or arg[1] == ".")
        ):  # fmt: skip
            out[-1] = f"{previous}={arg}"
        else:
            out.append(arg)
    return out


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
