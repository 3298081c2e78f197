"""Timing and checking one launch: median time (buffers rotated, under a CUDA graph when the
working set is small), the first call's output and finiteness, relative error, device memory."""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from common import capture_graph, gpu_ms

from .config import MAX_ROTATE, ROTATE_BELOW, ROTATE_TARGET, TOLERANCE
from .run import err_str


def time_calls(calls: Sequence[Callable[[], Any]], graph: bool) -> tuple[float, str]:
    """Median ms per call. `calls` rotate over distinct buffers; with `graph`, all of them are
    captured once in a CUDA graph and the graph's median time is divided by their number."""
    note = ""
    if graph and len(calls) > 1:
        g = None
        try:
            g = capture_graph(calls)
            torch.cuda.synchronize()
            ms = gpu_ms(g.replay) / len(calls)
            return ms, f"cuda_graph({len(calls)} calls, {len(calls)} buffers)"
        except Exception as e:  # capture refused: fall back to plain launches
            note = f" (graph capture failed: {err_str(e)[:200]})"
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
        finally:
            del g
    cycle = itertools.cycle(calls)
    ms = gpu_ms(lambda: next(cycle)())
    return ms, f"do_bench({len(calls)} buffers){note}"


def measure(
    calls: Sequence[Callable[[], torch.Tensor]], graph: bool
) -> tuple[dict[str, Any], torch.Tensor | None]:
    """First call (compiles, checks finiteness, output kept for cross-checks), then timing."""
    rec: dict[str, Any] = {}
    out0 = None
    try:
        t = time.perf_counter()
        out = calls[0]()
        torch.cuda.synchronize()
        rec["first_call_s"] = time.perf_counter() - t
        out0 = out.detach().clone()
        rec["finite"] = bool(torch.isfinite(out0).all())
        if not rec["finite"]:
            rec["error"] = "non-finite output"
            return rec, out0
        rec["ms"], rec["timing"] = time_calls(calls, graph)
    except Exception as e:
        rec["error"] = err_str(e)
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
    return rec, out0


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """max |a - ref| and that divided by max |ref| (chunked: outputs can be GiBs)."""
    a, ref = a.reshape(-1), ref.reshape(-1)
    if a.numel() != ref.numel():
        raise ValueError(f"size mismatch {a.numel()} vs {ref.numel()}")
    diff, den = 0.0, 0.0
    step = 1 << 26
    for s in range(0, a.numel(), step):
        x, y = a[s : s + step].float(), ref[s : s + step].float()
        diff = max(diff, (x - y).abs().max().item())
        den = max(den, y.abs().max().item())
    rel = diff / den if den > 0 else float("inf")
    return {"max_abs_err": diff, "max_rel_err": rel, "ok": bool(rel <= TOLERANCE)}


def free_bytes() -> int:
    """Device bytes available: free memory plus what PyTorch's allocator holds unused."""
    free, _ = torch.cuda.mem_get_info()
    return int(free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated())


def cleanup() -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def rotation_count(working_set: int) -> int:
    if working_set >= ROTATE_BELOW:
        return 1
    return max(2, min(MAX_ROTATE, math.ceil(ROTATE_TARGET / max(working_set, 1))))
