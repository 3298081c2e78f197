"""Programmatic dependent launch (PDL, Hopper and later): a kernel launched with
`launch_pdl=True` may be scheduled while the kernel before it in the stream is still running; it
calls `gdc_wait()` before it touches memory, which returns once that kernel has finished and its
writes are visible. What it saves is the launch gap between small back-to-back kernels (decode
steps of a few microseconds each, replayed from CUDA graphs).

Kernels that support it take `launch_pdl: tl.constexpr` (the launch option of the same name
turns the attribute on) and start with `pdl_jit.pdl_start(launch_pdl)`: the Mamba-2 decode
kernels, and every kernel of a decoder layer's decode step (the paged attention, its merge and
KV-cache write, the norm, rotary, activation and decode-row GEMM kernels; cuBLAS GEMMs between
them launch as usual, so a kernel after one simply waits for it).

`UNIFIED_ATTN_PDL=0` turns it off everywhere (for a comparison or a driver that misbehaves).
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """True when kernels on `device` launch with PDL: a CUDA device of compute capability 9.0
    or later, not Triton's CPU interpreter, and `UNIFIED_ATTN_PDL` is not "0" ("1" or unset;
    any other value is refused)."""
    setting = os.environ.get("UNIFIED_ATTN_PDL", "1")
    if setting not in ("0", "1"):
        raise ValueError(f"UNIFIED_ATTN_PDL={setting!r}: expected 0 or 1 (or unset: 1)")
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    if setting == "0":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())
