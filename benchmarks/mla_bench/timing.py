"""Timing: attn_bench's GPU helpers or wall-clock medians on the CPU, and the error metric."""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mla_bench.config import TOLERANCE


class Bench:
    """Device-specific timing: attn_bench's GPU helpers, or wall-clock medians on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy_tb_s: float | None = None  # set by the ceilings (bench_ceilings writes it)

    @property
    def gpu(self) -> bool:
        return self.device.type == "cuda"

    def log(self, msg: str) -> None:
        print(f"[mla_decode] {msg}", flush=True)

    def ceilings(self) -> dict[str, Any]:
        if self.gpu:
            from attn_bench.sections import bench_ceilings

            return bench_ceilings(self)  # type: ignore[arg-type]  # reads .log, sets .copy_tb_s
        src = torch.randn(1 << 24)
        dst = torch.empty_like(src)
        ms = cpu_ms(functools.partial(dst.copy_, src), repeats=5)
        moved = 2 * src.numel() * src.element_size()
        self.copy_tb_s = moved / ms / 1e9
        return {"copy": {"bytes_read_plus_written": moved, "ms": ms, "tb_s": self.copy_tb_s}}

    def measure(self, calls: Sequence[Callable[[], torch.Tensor]]) -> tuple[dict, torch.Tensor]:
        """First call's output (checked finite) and the median time of the calls."""
        if self.gpu:
            from attn_bench.timing import measure

            rec, out = measure(calls, graph=len(calls) > 1)
            if out is None:
                raise RuntimeError(rec.get("error", "no output"))
            return rec, out
        out = calls[0]().clone()
        rec = {"finite": bool(torch.isfinite(out).all()), "timing": "perf_counter median"}
        rec["ms"] = cpu_ms(calls[0], repeats=2)
        return rec, out

    def rotations(self, working_set: int) -> int:
        if not self.gpu:
            return 1
        from attn_bench.timing import rotation_count

        return rotation_count(working_set)


def cpu_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    diff = (a.float() - ref.float()).abs().max().item()
    den = ref.float().abs().max().item()
    rel = diff / den if den > 0 else math.inf
    return {"max_abs_err": diff, "max_rel_err": rel, "ok": rel <= TOLERANCE}
