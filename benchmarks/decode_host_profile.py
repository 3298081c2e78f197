"""`decode_fixed_cost.py --profile-host`: where our decode call's host time goes, at one shape
(batch 1 / 4k by default), each piece timed alone by `time.perf_counter_ns` per call over many
calls (median and p90; the GPU synchronized every 64 calls, outside the timed region, so the
launch queue never fills):

- `plan_split`: the split-KV plan (`TritonAttentionBackend.prep_forward`, once per step);
- `scratch_ensure`: `SplitScratch.ensure` on the already sized scratch (once per step in
  `prep_forward`, and again inside every launcher call of a split batch);
- `launcher_stubbed`: `ops.unified_attention` with its two Triton kernels replaced by stubs
  that only record their arguments: the launcher's Python checks and argument work (its
  `ensure` included), plus `stub_launches` (the stubs alone, timed too;
  `derived.python_checks_us` is the difference);
- `<kernel>_launch`: each recorded launch as the launcher makes it, through
  `kernels/launch.FastLaunch` (its own cache key, then the compiled kernel's launcher);
- `<kernel>_triton_dispatch_launch`: the same launch through Triton's `kernel[grid](...)`;
- `<kernel>_driver_launch`: the same launch through the compiled kernel's own launcher alone (no
  key at all: the floor);
  "error" where this Triton has no such path (the interpreter);
- `call_host`: the whole `unified_attention` call (host time only, no synchronize);
- `vllm_call_host`: vLLM's `unified_attention` call the same way, when the peer is loaded.

Main adds `eager_wall`: the eager wall time per call of the same shape (with synchronize).
"""

from __future__ import annotations

import inspect
import statistics
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
from common import percentile

SYNC_EVERY = 64


def per_call(fn: Callable[[], Any], iters: int, device: torch.device) -> dict[str, Any]:
    """Host us of one `fn()` call: median, p90, mean, min over `iters` timed calls."""
    fn()  # warm: compiled, cached
    times = []
    for i in range(iters):
        if device.type == "cuda" and i % SYNC_EVERY == 0:
            torch.cuda.synchronize()
        start = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - start) / 1e3)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {"median_us": statistics.median(times), "p90_us": percentile(times, 90),
            "mean_us": statistics.fmean(times), "min_us": min(times), "iters": iters}  # fmt: skip


class Recorder:
    """Stands in for a Triton kernel: `kernel[grid](*args, **kwargs)` records, launches nothing."""

    def __init__(self) -> None:
        self.grid: tuple[int, ...] = ()
        self.args: tuple[Any, ...] = ()
        self.kwargs: dict[str, Any] = {}
        self.calls = 0

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        self.grid = grid
        return self._launch

    def _launch(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs
        self.calls += 1


def driver_launch(kernel: Any, rec: Recorder) -> Callable[[], Any]:
    """The recorded launch through the compiled kernel's launcher, past Triton's dispatch."""
    compiled = kernel[rec.grid](*rec.args, **rec.kwargs)
    if compiled is None or not hasattr(compiled, "run"):
        raise RuntimeError("no compiled kernel to launch directly (the interpreter?)")
    signature = inspect.signature(kernel.fn)
    params = {k: v for k, v in rec.kwargs.items() if k in signature.parameters}
    bound = signature.bind(*rec.args, **params)
    bound.apply_defaults()
    values = tuple(bound.arguments.values())
    grid = tuple(rec.grid) + (1,) * (3 - len(rec.grid))
    runner = compiled[grid]
    return lambda: runner(*values)


def profile_host(case: Any, iters: int, vllm_call: Callable[[], Any] | None) -> dict[str, Any]:
    """The pieces of our host time per decode call at `case`'s shape (see the module doc)."""
    from unified_attn.backends.triton import ops

    p, device = case.p, case.device
    pieces: dict[str, dict[str, Any]] = {}

    def plan() -> Any:
        return ops.plan_split(max_query_len=1, max_seq_len=case.ctx, num_reqs=case.batch,
                              num_kv_heads=p["kv_heads"], device=device)  # fmt: skip

    split = plan()
    pieces["plan_split"] = per_call(plan, iters, device)
    scratch = ops.SplitScratch()
    rows, head_pad = case.batch * p["heads"], max(16, 1 << (p["head_size"] - 1).bit_length())
    if split is not None:
        scratch.ensure(rows, split.num_segments, head_pad, device)
        pieces["scratch_ensure"] = per_call(
            lambda: scratch.ensure(rows, split.num_segments, head_pad, device), iters, device
        )
    else:
        pieces["scratch_ensure"] = {"median_us": 0.0, "note": "no split at this shape"}
    cache, out = case.caches[0], torch.empty_like(case.q)

    def call() -> torch.Tensor:
        return ops.unified_attention(
            case.q, cache[:, 0], cache[:, 1], out, query_start_loc=case.qsl,
            seq_lens=case.seq_lens, block_table=case.table, num_seqs=case.batch,
            max_query_len=1, scale=case.scale, split=split, scratch=scratch,
        )  # fmt: skip

    # the launcher calls its kernels through `kernels/launch.FastLaunch` (`ops._ATTENTION`, ...)
    kernels = {"attention": (ops._ATTENTION, Recorder()), "merge": (ops._MERGE, Recorder())}
    with mock.patch.object(ops, "_ATTENTION", kernels["attention"][1]), \
         mock.patch.object(ops, "_MERGE", kernels["merge"][1]):  # fmt: skip
        pieces["launcher_stubbed"] = per_call(call, iters, device)
    recorded = {name: rec for name, (_, rec) in kernels.items() if rec.calls}

    def stubs() -> None:
        for rec in recorded.values():
            rec[rec.grid](*rec.args, **rec.kwargs)

    pieces["stub_launches"] = per_call(stubs, iters, device)
    for name, rec in recorded.items():
        fast = kernels[name][0]
        kernel = fast.kernel  # the @triton.jit function
        pieces[f"{name}_launch"] = per_call(  # FastLaunch: what the launcher pays
            lambda k=fast, r=rec: k[r.grid](*r.args, **r.kwargs), iters, device
        )
        pieces[f"{name}_triton_dispatch_launch"] = per_call(
            lambda k=kernel, r=rec: k[r.grid](*r.args, **r.kwargs), iters, device
        )
        try:
            pieces[f"{name}_driver_launch"] = per_call(driver_launch(kernel, rec), iters, device)
        except Exception as error:  # a Triton without this path: say so, keep the rest
            pieces[f"{name}_driver_launch"] = {"error": f"{type(error).__name__}: {error}"[:300]}
    pieces["call_host"] = per_call(call, iters, device)
    if vllm_call is not None:
        try:
            pieces["vllm_call_host"] = per_call(vllm_call, iters, device)
        except Exception as error:  # vLLM's op failed: ours stands
            pieces["vllm_call_host"] = {"error": f"{type(error).__name__}: {error}"[:300]}
    return {"batch": case.batch, "ctx": case.ctx, "iters": iters,
            "split": None if split is None else [split.num_segments, split.segment],
            "pieces": pieces, "derived": derived(pieces, list(recorded))}  # fmt: skip


def derived(pieces: dict[str, dict[str, Any]], kernels: list[str]) -> dict[str, float | None]:
    """Medians combined: the launcher's own checks, Triton's launches and its Python dispatch."""

    def med(name: str) -> float | None:
        return pieces.get(name, {}).get("median_us")

    checks = med("launcher_stubbed")
    stub = med("stub_launches")
    launches = [med(f"{k}_launch") for k in kernels]
    drivers = [med(f"{k}_driver_launch") for k in kernels]
    launch_sum = sum(x for x in launches if x is not None) if launches else 0.0
    out: dict[str, float | None] = {
        "per_step_us": (med("plan_split") or 0.0) + (med("scratch_ensure") or 0.0),
        "python_checks_us": None if checks is None or stub is None else checks - stub,
        "triton_launches_us": launch_sum,
        "triton_dispatch_us": None,
        "launcher_total_us": None if checks is None or stub is None else checks - stub + launch_sum,
        "call_host_us": med("call_host"),  # about launcher_total_us
    }
    if drivers and all(x is not None for x in drivers):
        out["triton_dispatch_us"] = launch_sum - sum(x for x in drivers if x is not None)
    return out
