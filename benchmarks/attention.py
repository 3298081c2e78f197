"""Attention-kernel benchmark on one GPU: the Triton unified paged kernel against same-run peers.

    python benchmarks/attention.py --out DIR [--quick] [--no-flex] [--no-plot] [--budget-s S]
                                   [--sections decode,prefill,window,features,split]

Shapes: 32 query heads / 8 KV heads / head size 128, bf16, page (block) size 16, random data,
random non-contiguous block tables (a random permutation of block ids).

* ceilings (always): device-to-device copy bandwidth (bytes read + written, 2 GiB buffers) and a
  bf16 8192^3 matmul, measured in the same run; decode figures are reported as a fraction of the
  copy bandwidth.
* decode: batch x context grid, uniform lengths and a skewed variant (lognormal lengths, same total
  tokens). Ours uses `TritonAttentionBackend.plan_split` for split-KV and a pre-sized
  `SplitScratch`. Bytes read = K+V of the visible tokens + Q + output; reported as TB/s and % of
  the copy bandwidth. Peers: torch SDPA (FLASH_ATTENTION and CUDNN_ATTENTION backends) on dense
  contiguous K/V, once with `enable_gqa=True` (q [B, 32, 1, D], k/v [B, 8, L, D]) and once with the
  query heads of a KV head packed as query rows (q [B, 8, 4, D], non-causal: the same math);
  compiled FlexAttention dense (length block mask) and paged (gather-free: the block mask points at
  physical pages of a [1, 8, pages * 16, D] cache; torch's experimental `PagedAttention` when
  importable, else an equivalent inverse-page-table mask_mod). Peers read the same data as ours
  (derived from our cache), so outputs are cross-checked.
* prefill: causal, one sequence and batch 4, L in 2k..32k; TFLOP/s with
  FLOPs = 4 * sum over queries of visible keys * Hq * D; peers SDPA flash / cuDNN (is_causal) and
  compiled FlexAttention (causal block mask).
* window: W=1024 at L=32k (ours) against our full causal at 32k: speedup as % of the tile-count
  ideal L / (2W); FlexAttention with a sliding-window mask_mod for reference.
* features: sinks (random [32] float32) and soft cap 30 against plain, decode B=32 ctx 8k and
  prefill 8k: % overhead.
* split: decode B=1 at 32k with the split plan against `split=None`.

Timing: `triton.testing.do_bench(warmup=25, rep=100, return_mode="median")`, which clears L2
before every call; when a call's working set is under 200 MB, several buffers are rotated and the
rotation is captured in a CUDA graph (median graph time / calls). Every output is checked finite
before timing; ours is compared with an fp32 reference at small shapes in every section and with
the peers at the timed shapes (max |diff| / max |ref|, bf16 tolerance 2e-2). FlexAttention compile
time is excluded (first call), recorded as `first_call_s`. Progress lines are flushed as they come;
`DIR/attention.json` is rewritten after every shape, the table and `DIR/attention.png` come at the
end (also on SIGTERM / Ctrl-C, then with exit code 1). A soft time budget (`--budget-s`) skips
FlexAttention compiles and further shapes, recording them as skipped, once it runs short. Without
CUDA the script exits with code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import json
import math
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from unified_attn.harness.bench import machine_info

HQ, HKV, HEAD, PAGE = 32, 8, 128, 16
QPK = HQ // HKV
DTYPE = torch.bfloat16
ELT = 2  # bytes per bf16 element
SCALE = HEAD**-0.5
KV_BYTES_PER_TOKEN = 2 * HKV * HEAD * ELT  # K and V
GIB = 1 << 30
ROTATE_BELOW = 200e6  # bytes: smaller working sets rotate buffers (L2 is 50 MB)
ROTATE_TARGET = 256 << 20  # bytes covered by one rotation
MAX_ROTATE = 64
MAX_KV_BYTES = 40 * GIB
TOLERANCE = 2e-2  # max |diff| / max |ref|, bf16
SEED = 1234
SOFT_CAP = 30.0
WINDOW = 1024
WARMUP_MS, REP_MS = 25, 100
SECTIONS = ("decode", "prefill", "window", "features", "split")
FLEX_COMPILE_COST_S = 25.0  # what a FlexAttention compile is assumed to cost (budget guard)

TARGETS = {
    "decode_large_tb_s": 3.0,  # KV >= 4 GiB
    "decode_large_min_kv_gib": 4.0,
    "decode_mid_tb_s": 2.7,  # B 16-32, ctx 8k
    "decode_b1_32k_tb_s": 1.5,
    "decode_vs_flex_paged": 1.5,  # time ratio, large work
    "prefill_vs_sdpa_flash": 1.2,
    "prefill_vs_sdpa_cudnn_stretch": 0.9,
    "window_pct_of_ideal": 50.0,
    "feature_overhead_pct": 3.0,
}

_DECODE_GRID = [
    (b, c) for b in (1, 4, 16, 32, 64, 128, 256) for c in (1024, 4096, 8192, 16384, 32768)
]
# Shapes the targets name (and the FlexAttention ones) run first, so that a budget overrun skips
# the least important ones.
_DECODE_FIRST = [(1, 32768), (16, 8192), (32, 8192), (128, 8192), (256, 4096), (64, 16384)]

FULL_PARAMS: dict[str, Any] = {
    "decode_shapes": _DECODE_FIRST + [s for s in _DECODE_GRID if s not in _DECODE_FIRST],
    "flex_decode_shapes": [(1, 32768), (16, 8192), (32, 8192), (128, 8192), (256, 4096)],
    "prefill_shapes": [(b, n) for b in (1, 4) for n in (2048, 4096, 8192, 16384, 32768)],
    "flex_prefill_shapes": [(b, n) for b in (1, 4) for n in (2048, 4096, 8192, 16384, 32768)],
    "window_len": 32768,
    "features_decode": (32, 8192),
    "features_prefill_len": 8192,
    "split_ctx": 32768,
    "flex_window": True,
    "flex_dense_decode": True,
    "budget_s": 450.0,
    # Seconds kept for each later section when an earlier one decides what it can still afford
    # (their minimum without FlexAttention compiles).
    "reserve_s": {"decode": 0.0, "prefill": 30.0, "window": 10.0, "features": 15.0, "split": 4.0},
}
QUICK_PARAMS: dict[str, Any] = {
    "decode_shapes": [(1, 32768), (32, 8192), (128, 8192)],
    "flex_decode_shapes": [(128, 8192)],
    "prefill_shapes": [(1, 16384), (1, 4096), (4, 4096)],
    "flex_prefill_shapes": [(1, 16384)],
    "window_len": 32768,
    "features_decode": (32, 8192),
    "features_prefill_len": 8192,
    "split_ctx": 32768,
    "flex_window": False,
    "flex_dense_decode": False,
    "budget_s": 105.0,
    "reserve_s": {"decode": 0.0, "prefill": 10.0, "window": 6.0, "features": 10.0, "split": 3.0},
}


class Interrupted(BaseException):
    """Raised by the SIGTERM handler so that partial results are still written (a
    BaseException, so that the per-peer `except Exception` handlers let it through)."""


# ---- run state -------------------------------------------------------------------------------


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
        self.out_dir = Path(args.out)
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
        tmp = self.json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.results, indent=2, default=_json_default) + "\n")
        tmp.replace(self.json_path)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, (torch.dtype, torch.device, Path)):
        return str(obj)
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    raise TypeError(f"not JSON serialisable: {type(obj)}")


def err_str(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:800]


# ---- timing ----------------------------------------------------------------------------------


def do_bench(fn: Callable[[], Any]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median"))


def time_calls(calls: Sequence[Callable[[], Any]], graph: bool) -> tuple[float, str]:
    """Median ms per call. `calls` rotate over distinct buffers; with `graph`, all of them are
    captured once in a CUDA graph and the graph's median time is divided by their number."""
    note = ""
    if graph and len(calls) > 1:
        g = None
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for c in calls:
                    c()
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for c in calls:
                    c()
            torch.cuda.synchronize()
            ms = do_bench(g.replay) / len(calls)
            return ms, f"cuda_graph({len(calls)} calls, {len(calls)} buffers)"
        except Exception as e:  # capture refused: fall back to plain launches
            note = f" (graph capture failed: {err_str(e)[:200]})"
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
        finally:
            del g
    cycle = itertools.cycle(calls)
    ms = do_bench(lambda: next(cycle)())
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


# ---- data and metadata -----------------------------------------------------------------------


def randn(*shape: int, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="cuda").normal_()


def rand_cache(num_blocks: int) -> torch.Tensor:
    """KV cache `[num_blocks, 2, PAGE, HKV, HEAD]`: `cache[:, 0]` is K, `cache[:, 1]` V."""
    return randn(num_blocks, 2, PAGE, HKV, HEAD)


def blocks_of(lens: Sequence[int]) -> int:
    return sum(-(-n // PAGE) for n in lens)


@dataclasses.dataclass
class Meta:
    """Device-side batch description for ours, plus the split plan."""

    lens: list[int]
    q_lens: list[int]
    qsl: torch.Tensor
    seq_lens: torch.Tensor
    bt: torch.Tensor  # [B, max_blocks] int32, physical block ids
    nblk: list[int]
    max_q: int
    plan: Any
    scratch: Any

    @property
    def B(self) -> int:
        return len(self.lens)

    @property
    def T(self) -> int:
        return sum(self.q_lens)


def make_meta(
    lens: Sequence[int], q_lens: Sequence[int], perm: torch.Tensor, dev: torch.device
) -> Meta:
    """Block table from the permutation `perm` (random physical ids), metadata, split plan."""
    from unified_attn.backend import CommonAttentionMetadata
    from unified_attn.backends.triton.backend import TritonAttentionBackend
    from unified_attn.backends.triton.ops import SplitScratch

    lens, q_lens = list(lens), list(q_lens)
    nblk = [-(-n // PAGE) for n in lens]
    if sum(nblk) > perm.numel():
        raise ValueError(f"{sum(nblk)} blocks needed, {perm.numel()} in the cache")
    bt = torch.zeros(len(lens), max(nblk), dtype=torch.int32)
    pos = 0
    for i, n in enumerate(nblk):
        bt[i, :n] = perm[pos : pos + n]
        pos += n
    qsl_cpu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl_cpu[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    sl_cpu = torch.tensor(lens, dtype=torch.int32)
    positions = torch.cat(
        [torch.arange(n - q, n, dtype=torch.int64) for n, q in zip(lens, q_lens, strict=True)]
    )
    common = CommonAttentionMetadata(
        query_start_loc=qsl_cpu.to(dev),
        query_start_loc_cpu=qsl_cpu,
        seq_lens=sl_cpu.to(dev),
        seq_lens_cpu=sl_cpu,
        num_computed_tokens_cpu=sl_cpu - torch.tensor(q_lens, dtype=torch.int32),
        positions=positions.to(dev),
        num_reqs=len(lens),
        num_actual_tokens=sum(q_lens),
        max_query_len=max(q_lens),
        max_seq_len=max(lens),
        slot_mappings={},
    )
    backend = TritonAttentionBackend(num_kv_heads=HKV, head_size=HEAD, dtype=DTYPE)
    plan = backend.plan_split(common)
    scratch = SplitScratch()
    if plan is not None:  # pre-size outside the timed region
        scratch.ensure(rows=sum(q_lens) * HQ, segments=plan.num_segments, head_pad=HEAD, device=dev)
    return Meta(
        lens=lens,
        q_lens=q_lens,
        qsl=common.query_start_loc,
        seq_lens=common.seq_lens,
        bt=bt.to(dev),
        nblk=nblk,
        max_q=max(q_lens),
        plan=plan,
        scratch=scratch,
    )


def plan_dict(plan: Any) -> dict[str, int] | None:
    return None if plan is None else {"num_segments": plan.num_segments, "segment": plan.segment}


def ours_fn(
    q: torch.Tensor,
    cache: torch.Tensor,
    out: torch.Tensor,
    meta: Meta,
    *,
    use_plan: bool = True,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> Callable[[], torch.Tensor]:
    from unified_attn.backends.triton.ops import unified_attention

    k_cache, v_cache = cache[:, 0], cache[:, 1]
    plan = meta.plan if use_plan else None

    def call() -> torch.Tensor:
        return unified_attention(
            q,
            k_cache,
            v_cache,
            out,
            query_start_loc=meta.qsl,
            seq_lens=meta.seq_lens,
            block_table=meta.bt,
            num_seqs=meta.B,
            max_query_len=meta.max_q,
            scale=SCALE,
            causal=True,
            window=window,
            soft_cap=soft_cap,
            sinks=sinks,
            split=plan,
            scratch=meta.scratch,
        )

    return call


def skewed_lengths(batch: int, ctx: int, rng: random.Random, sigma: float = 1.5) -> list[int]:
    """Lognormal lengths with the same total as `batch * ctx`: a few requests are long."""
    if batch == 1:
        return [ctx]
    total, lo, cap = batch * ctx, PAGE, max(ctx, min(8 * ctx, 131072))
    w = [rng.lognormvariate(0.0, sigma) for _ in range(batch)]
    lens = [x / sum(w) * total for x in w]
    for _ in range(100):
        lens = [min(max(x, lo), cap) for x in lens]
        excess = total - sum(lens)
        movable = [i for i, x in enumerate(lens) if (lo < x < cap)]
        if abs(excess) < 0.5 or not movable:
            break
        s = sum(lens[i] for i in movable)
        for i in movable:
            lens[i] += excess * lens[i] / s
    out = [round(x) for x in lens]
    diff = total - sum(out)
    order = sorted(range(batch), key=lambda i: -out[i])
    for i in itertools.cycle(order):
        if diff == 0:
            break
        step = 1 if diff > 0 else -1
        if lo <= out[i] + step <= cap:
            out[i] += step
            diff -= step
    return out


def lens_stats(lens: Sequence[int]) -> dict[str, Any]:
    return {
        "n": len(lens),
        "total": sum(lens),
        "min": min(lens),
        "median": statistics.median(lens),
        "max": max(lens),
    }


def dense_kv(cache: torch.Tensor, bt: torch.Tensor, length: int) -> tuple[torch.Tensor, ...]:
    """Contiguous k, v `[B, HKV, length, HEAD]` gathered from the paged cache (uniform lengths)."""
    batch, nblk = bt.shape[0], -(-length // PAGE)
    k = torch.empty(batch, HKV, length, HEAD, dtype=DTYPE, device=cache.device)
    v = torch.empty_like(k)
    rows = max(1, GIB // (nblk * PAGE * HKV * HEAD * ELT))
    for s in range(0, batch, rows):
        idx = bt[s : s + rows, :nblk].long()
        for which, dst in ((0, k), (1, v)):
            blocks = cache[idx, which]  # [r, nblk, PAGE, HKV, HEAD]
            r = blocks.shape[0]
            dst[s : s + r] = blocks.reshape(r, nblk * PAGE, HKV, HEAD)[:, :length].transpose(1, 2)
    return k, v


def flex_paged_kv(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same pages in FlexAttention's paged layout `[1, HKV, num_blocks * PAGE, HEAD]`
    (physical token index = block id * PAGE + offset, as in torch's PagedAttention)."""
    nb = cache.shape[0]
    k = cache[:, 0].permute(2, 0, 1, 3).reshape(1, HKV, nb * PAGE, HEAD)
    v = cache[:, 1].permute(2, 0, 1, 3).reshape(1, HKV, nb * PAGE, HEAD)
    return k.contiguous(), v.contiguous()


# ---- fp32 reference (small shapes only) ------------------------------------------------------


def reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: Meta,
    *,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    qsl = meta.qsl.tolist()
    bt = meta.bt.long()
    for i, seq_len in enumerate(meta.lens):
        s, e = qsl[i], qsl[i + 1]
        blocks = bt[i, : meta.nblk[i]]
        k = cache[blocks, 0].reshape(-1, HKV, HEAD)[:seq_len].float()
        v = cache[blocks, 1].reshape(-1, HKV, HEAD)[:seq_len].float()
        k = k.repeat_interleave(QPK, dim=1)
        v = v.repeat_interleave(QPK, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q[s:e].float(), k) * SCALE
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = torch.arange(seq_len - (e - s), seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if window:
            allowed &= q_pos - k_pos < window
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        if sinks is not None:
            col = sinks.float()[:, None, None].expand(HQ, e - s, 1)
            probs = torch.softmax(torch.cat([scores, col], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[s:e] = torch.einsum("hnl,lhd->nhd", probs, v)
    return out


def ref_check(
    run: Run,
    name: str,
    lens: Sequence[int],
    q_lens: Sequence[int],
    *,
    use_plan: bool = True,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Ours against the fp32 reference at a small shape (random block table)."""
    rec: dict[str, Any] = {"name": name, "lens": list(lens), "q_lens": list(q_lens)}
    try:
        nb = blocks_of(lens) + 3
        cache = rand_cache(nb)
        meta = make_meta(lens, q_lens, torch.randperm(nb, generator=run.gen), run.dev)
        rec["split"] = plan_dict(meta.plan) if use_plan else None
        q = randn(meta.T, HQ, HEAD)
        out = torch.empty_like(q)
        ours_fn(
            q, cache, out, meta, use_plan=use_plan, window=window, soft_cap=soft_cap, sinks=sinks
        )()
        ref = reference(q, cache, meta, window=window, soft_cap=soft_cap, sinks=sinks)
        rec["finite"] = bool(torch.isfinite(out).all())
        rec.update(rel_err(out, ref))
        rec["ok"] = rec["ok"] and rec["finite"]
    except Exception as e:
        rec.update(ok=False, error=err_str(e))
    status = "ok" if rec.get("ok") else "FAILED"
    run.log(f"check {name}: {status} rel err {rec.get('max_rel_err', float('nan')):.2e}")
    return rec


# ---- peers: SDPA and FlexAttention -----------------------------------------------------------


def sdpa_fn(
    backend_name: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    gqa: bool,
) -> Callable[[], torch.Tensor]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    kwargs = {"enable_gqa": True} if gqa else {}

    def call() -> torch.Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=SCALE, **kwargs)

    return call


_FLEX: dict[str, Any] = {}


def flex_compiled() -> Callable[..., torch.Tensor]:
    """`torch.compile(flex_attention, dynamic=False)`: one static compile per shape family."""
    if "fn" not in _FLEX:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        cfg = torch._dynamo.config
        for name, value in (
            ("cache_size_limit", 512),
            ("recompile_limit", 512),
            ("accumulated_cache_size_limit", 4096),
            ("accumulated_recompile_limit", 4096),
        ):
            if hasattr(cfg, name):
                with contextlib.suppress(Exception):
                    setattr(cfg, name, value)
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def flex_fn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any
) -> Callable[[], torch.Tensor]:
    fn = flex_compiled()

    def call() -> torch.Tensor:
        return fn(q, k, v, block_mask=block_mask, scale=SCALE, enable_gqa=True)

    return call


def _length_block_tensors(
    lens: torch.Tensor, kv_block: int, num_cols: int
) -> tuple[torch.Tensor, ...]:
    """Block lists for a query that sees keys `[0, len)`: the complete KV blocks are "full"
    (no mask_mod), a trailing incomplete one is "partial"."""
    batch = lens.numel()
    cols = torch.arange(num_cols, dtype=torch.int32, device=lens.device)
    full = (lens // kv_block).to(torch.int32)
    part = (lens % kv_block > 0).to(torch.int32)
    full_idx = cols.expand(batch, num_cols).contiguous()
    part_idx = ((cols[None, :] + full[:, None]) % num_cols).to(torch.int32)  # first = partial
    return (
        part.view(batch, 1, 1),
        part_idx.view(batch, 1, 1, num_cols),
        full.view(batch, 1, 1),
        full_idx.view(batch, 1, 1, num_cols),
    )


def flex_dense_decode_mask(lens: torch.Tensor, kv_len: int) -> Any:
    from torch.nn.attention.flex_attention import BlockMask

    def length_mask(b, h, q_idx, kv_idx):
        return kv_idx < lens[b]

    kv_block = 128
    part_n, part_i, full_n, full_i = _length_block_tensors(lens, kv_block, -(-kv_len // kv_block))
    return BlockMask.from_kv_blocks(
        part_n,
        part_i,
        full_n,
        full_i,
        BLOCK_SIZE=(128, kv_block),
        mask_mod=length_mask,
        seq_lengths=(1, kv_len),
    )


def flex_paged_decode_mask(meta: Meta, num_pages: int) -> tuple[Any, str]:
    """Block mask over physical pages (block size = PAGE) for a `[1, HKV, num_pages * PAGE, D]`
    cache. Uses torch's experimental PagedAttention when importable, else the same construction
    here: complete pages are full blocks; a trailing partial page goes through a mask_mod that maps
    the physical key index back to its logical position through an inverse page table."""
    from torch.nn.attention.flex_attention import BlockMask

    dev = meta.bt.device
    lens = meta.seq_lens.long()
    batch, width = meta.bt.shape
    cols = torch.arange(width, device=dev)
    nblk = torch.tensor(meta.nblk, device=dev)
    valid = cols[None, :] < nblk[:, None]
    rows = torch.arange(batch, device=dev)[:, None].expand(batch, width)
    bt = meta.bt.long()

    def logical_length_mask(b, h, q_idx, kv_idx):
        return kv_idx < lens[b]

    part_n, part_i, full_n, full_i = _length_block_tensors(meta.seq_lens, PAGE, width)
    try:
        from torch.nn.attention.experimental._paged_attention import PagedAttention
    except ImportError:
        PagedAttention = None
    if PagedAttention is not None:
        logical = BlockMask.from_kv_blocks(
            part_n,
            part_i,
            full_n,
            full_i,
            BLOCK_SIZE=(128, PAGE),
            mask_mod=logical_length_mask,
            seq_lengths=(1, width * PAGE),
        )
        pa = PagedAttention(num_pages, PAGE, batch, device=str(dev))
        pa.page_table[:, :width] = torch.where(valid, bt, torch.full_like(bt, -1))
        pa.physical_to_logical[rows[valid], bt[valid]] = cols.expand(batch, width)[valid]
        return pa.convert_logical_block_mask(logical), "torch PagedAttention"

    p2l = torch.full((batch, num_pages), -1, dtype=torch.int64, device=dev)
    p2l[rows[valid], bt[valid]] = cols.expand(batch, width)[valid]

    def paged_mask(b, h, q_idx, kv_idx):
        logical_block = p2l[b, kv_idx // PAGE]
        pos = logical_block * PAGE + kv_idx % PAGE
        return (logical_block >= 0) & (pos < lens[b])

    def physical(idx: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(batch, 1, 1, num_pages, dtype=torch.int32, device=dev)
        out[..., :width] = torch.gather(bt, 1, idx.view(batch, width).long()).view(
            batch, 1, 1, width
        )
        return out

    mask = BlockMask.from_kv_blocks(
        part_n,
        physical(part_i),
        full_n,
        physical(full_i),
        BLOCK_SIZE=(128, PAGE),
        mask_mod=paged_mask,
        seq_lengths=(1, num_pages * PAGE),
    )
    return mask, "own inverse-page-table mask_mod"


def flex_prefill_mask(length: int, device: torch.device, window: int | None = None) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    if window:

        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    else:

        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

    return create_block_mask(mask_mod, None, None, length, length, device=device)


def flex_allowed(run: Run, section: str, what: str) -> str | None:
    """None if a FlexAttention compile fits the budget, else why it is skipped."""
    if run.args.no_flex:
        return "skipped (--no-flex)"
    if run.left_for(section) < FLEX_COMPILE_COST_S:
        return f"skipped: time budget ({what})"
    return None


# ---- ceilings --------------------------------------------------------------------------------


def bench_ceilings(run: Run) -> dict[str, Any]:
    res: dict[str, Any] = {}
    n = 2 * GIB // ELT
    src = randn(n)
    dst = torch.empty_like(src)
    ms = do_bench(functools.partial(dst.copy_, src))
    moved = 2 * n * ELT
    res["copy"] = {"bytes_read_plus_written": moved, "ms": ms, "tb_s": moved / ms / 1e9}
    del src, dst
    m = 8192
    a, b = randn(m, m), randn(m, m)
    c = torch.empty_like(a)
    ms = do_bench(functools.partial(torch.matmul, a, b, out=c))
    res["matmul_bf16_8192"] = {"flops": 2 * m**3, "ms": ms, "tflop_s": 2 * m**3 / ms / 1e9}
    del a, b, c
    cleanup()
    run.copy_tb_s = res["copy"]["tb_s"]
    run.log(
        f"ceilings: copy {res['copy']['tb_s']:.2f} TB/s, "
        f"bf16 matmul {res['matmul_bf16_8192']['tflop_s']:.0f} TFLOP/s"
    )
    return res


# ---- decode ----------------------------------------------------------------------------------


def decode_bytes(lens: Sequence[int]) -> int:
    return sum(lens) * KV_BYTES_PER_TOKEN + 2 * len(lens) * HQ * HEAD * ELT


def add_bw(run: Run, rec: dict[str, Any], nbytes: int, ours_ms: float | None) -> None:
    if "ms" not in rec:
        return
    rec["tb_s"] = nbytes / rec["ms"] / 1e9
    if run.copy_tb_s:
        rec["pct_of_copy"] = 100.0 * rec["tb_s"] / run.copy_tb_s
    if ours_ms:
        rec["ours_speedup"] = rec["ms"] / ours_ms  # > 1: ours is faster


def decode_shape(run: Run, batch: int, ctx: int, with_flex: bool) -> dict[str, Any]:
    rec: dict[str, Any] = {"B": batch, "ctx": ctx}
    lens_u = [ctx] * batch
    lens_s = skewed_lengths(batch, ctx, run.rng) if batch > 1 else None
    nb = max(blocks_of(lens_u), blocks_of(lens_s) if lens_s else 0) + 1
    nb = -(-nb // 8) * 8  # FlexAttention's paged KV length (nb * 16) a multiple of 128
    kv_bytes = batch * ctx * KV_BYTES_PER_TOKEN
    rec["kv_gib"] = kv_bytes / GIB
    n_rot = rotation_count(kv_bytes)
    graph = n_rot > 1
    rec["rotation_buffers"] = n_rot
    caches = [rand_cache(nb) for _ in range(n_rot)]
    perm = torch.randperm(nb, generator=run.gen)
    q = randn(batch, HQ, HEAD)
    variants = {"uniform": lens_u}
    if lens_s is not None:
        variants["skewed"] = lens_s
    metas: dict[str, Meta] = {}
    outs: dict[str, torch.Tensor | None] = {}
    for vname, lens in variants.items():
        meta = make_meta(lens, [1] * batch, perm, run.dev)
        metas[vname] = meta
        out = torch.empty_like(q)
        r, outs[vname] = measure([ours_fn(q, c, out, meta) for c in caches], graph)
        nbytes = decode_bytes(lens)
        add_bw(run, r, nbytes, None)
        rec[vname] = {
            "lens": lens_stats(lens),
            "bytes_read": nbytes,
            "split": plan_dict(meta.plan),
            "ours": r,
        }
    if run.left_for("decode") > 5:
        decode_dense_peers(run, rec, q, caches, metas["uniform"], outs["uniform"], graph, with_flex)
        cleanup()
    if with_flex:
        decode_flex_paged(run, rec, q, caches, metas, outs, graph)
        cleanup()
    del caches, metas, outs
    cleanup()
    return rec


def decode_dense_peers(
    run: Run,
    rec: dict[str, Any],
    q: torch.Tensor,
    caches: list[torch.Tensor],
    meta: Meta,
    ours_out: torch.Tensor | None,
    graph: bool,
    with_flex: bool,
) -> None:
    """SDPA (flash, cuDNN; GQA and packed) and dense FlexAttention on contiguous copies of the
    same K/V (uniform lengths). A function, so that the copies are freed when it returns."""
    uni = rec["uniform"]
    batch, ctx = meta.B, meta.lens[0]
    ours_ms, nbytes = uni["ours"].get("ms"), uni["bytes_read"]
    try:
        if len(caches) == 1 and not free_bytes() > batch * ctx * KV_BYTES_PER_TOKEN + 2 * GIB:
            raise MemoryError(f"no room for a dense copy of {rec['kv_gib']:.1f} GiB")
        dense = [dense_kv(c, meta.bt, ctx) for c in caches]
        q4 = q.view(batch, HQ, 1, HEAD)
        qp = q.view(batch, HKV, QPK, HEAD)  # the query heads of a KV head as query rows
        peers: list[tuple[str, Callable[..., Callable[[], torch.Tensor]]]] = []
        for backend, label in (
            ("FLASH_ATTENTION", "sdpa_flash"),
            ("CUDNN_ATTENTION", "sdpa_cudnn"),
        ):
            peers.append(
                (f"{label}_gqa", functools.partial(sdpa_fn, backend, q4, causal=False, gqa=True))
            )
            peers.append(
                (
                    f"{label}_packed",
                    functools.partial(sdpa_fn, backend, qp, causal=False, gqa=False),
                )
            )
        if with_flex and run.params["flex_dense_decode"]:
            why = flex_allowed(run, "decode", "flex dense decode")
            if why:
                uni["flex_dense"] = {"error": why}
            else:
                mask = flex_dense_decode_mask(meta.seq_lens, ctx)
                peers.append(("flex_dense", functools.partial(flex_fn, q4, block_mask=mask)))
        for name, make in peers:
            r, o = measure([make(k, v) for k, v in dense], graph)
            add_bw(run, r, nbytes, ours_ms)
            if o is not None and ours_out is not None and "error" not in r:
                r["vs_ours"] = rel_err(ours_out, o)
            uni[name] = r
    except Exception as e:
        uni.setdefault("peer_error", err_str(e))


def decode_flex_paged(
    run: Run,
    rec: dict[str, Any],
    q: torch.Tensor,
    caches: list[torch.Tensor],
    metas: dict[str, Meta],
    outs: dict[str, torch.Tensor | None],
    graph: bool,
) -> None:
    """FlexAttention over the same pages in its paged layout (gather-free paged attention)."""
    try:
        why = flex_allowed(run, "decode", "flex paged decode")
        if why:
            raise RuntimeError(why)
        kv_bytes = sum(metas["uniform"].lens) * KV_BYTES_PER_TOKEN
        if len(caches) == 1 and not free_bytes() > kv_bytes + 3 * GIB:
            raise MemoryError(f"no room for a paged copy of {rec['kv_gib']:.1f} GiB")
        paged = [flex_paged_kv(c) for c in caches]
        for vname, meta in metas.items():
            mask, how = flex_paged_decode_mask(meta, caches[0].shape[0])
            q4 = q.view(meta.B, HQ, 1, HEAD)
            r, o = measure([flex_fn(q4, k, v, mask) for k, v in paged], graph)
            r["implementation"] = how
            add_bw(run, r, rec[vname]["bytes_read"], rec[vname]["ours"].get("ms"))
            if o is not None and outs[vname] is not None and "error" not in r:
                r["vs_ours"] = rel_err(outs[vname], o)
            rec[vname]["flex_paged"] = r
    except Exception as e:
        for vname in metas:
            rec[vname].setdefault("flex_paged", {"error": err_str(e)})


def best_peer(v: dict[str, Any], label: str) -> dict[str, Any] | None:
    """The faster of the `gqa` and `packed` variants of an SDPA backend."""
    recs = [v.get(f"{label}_{x}") for x in ("gqa", "packed")]
    recs = [r for r in recs if r and "ms" in r]
    return min(recs, key=lambda r: r["ms"]) if recs else None


def fmt_peer(r: dict[str, Any] | None, key: str = "tb_s") -> str:
    if r is None:
        return "-"
    if key in r:
        return f"{r[key]:.2f}"
    return "err" if "error" in r else "-"


def bench_decode(run: Run) -> None:
    p = run.params
    res: dict[str, Any] = {"shapes": [], "skipped": [], "checks": []}
    run.results["decode"] = res
    res["checks"].append(
        ref_check(run, "decode ragged, split plan", [1000, 37, 2500, 16, 4101], [1] * 5)
    )
    res["checks"].append(
        ref_check(
            run, "decode ragged, no split", [1000, 37, 2500, 16, 4101], [1] * 5, use_plan=False
        )
    )
    run.save()
    flex_shapes = {tuple(s) for s in p["flex_decode_shapes"]}
    for batch, ctx in p["decode_shapes"]:
        kv = batch * ctx * KV_BYTES_PER_TOKEN
        if kv > MAX_KV_BYTES:
            res["skipped"].append({"B": batch, "ctx": ctx, "why": "KV over 40 GiB"})
            continue
        if run.left_for("decode") < 5:
            res["skipped"].append({"B": batch, "ctx": ctx, "why": "time budget"})
            run.log(f"decode B={batch} ctx={ctx}: skipped (time budget)")
            continue
        try:
            rec = decode_shape(run, batch, ctx, (batch, ctx) in flex_shapes)
        except Exception as e:
            rec = {"B": batch, "ctx": ctx, "error": err_str(e)}
            cleanup()
        res["shapes"].append(rec)
        run.save()
        run.log(decode_line(rec))


def decode_line(rec: dict[str, Any]) -> str:
    head = f"decode B={rec['B']:>3} ctx={rec['ctx']:>5}"
    if "error" in rec:
        return f"{head}: ERROR {rec['error']}"
    u = rec["uniform"]
    o = u["ours"]
    if "ms" not in o:
        return f"{head}: ours ERROR {o.get('error')}"
    parts = [
        f"{head} ({rec['kv_gib']:.2f} GiB): ours {o['ms'] * 1e3:8.1f} us "
        f"{o['tb_s']:.2f} TB/s ({o.get('pct_of_copy', float('nan')):.0f}% copy)"
    ]
    if "skewed" in rec and "tb_s" in rec["skewed"]["ours"]:
        parts.append(f"skewed {rec['skewed']['ours']['tb_s']:.2f}")
    for label in ("sdpa_flash", "sdpa_cudnn"):
        parts.append(f"{label} {fmt_peer(best_peer(u, label))}")
    if "flex_dense" in u:
        parts.append(f"flex {fmt_peer(u['flex_dense'])}")
    if "flex_paged" in u:
        fp = u["flex_paged"]
        parts.append(f"flex_paged {fmt_peer(fp)}")
        if "ours_speedup" in fp:
            parts.append(f"ours/flex_paged {fp['ours_speedup']:.2f}x")
    return " | ".join(parts)


# ---- prefill ---------------------------------------------------------------------------------


def causal_visible(q_len: int, seq_len: int, window: int | None = None) -> int:
    """Sum over the queries of their visible keys (queries at the last `q_len` positions)."""
    total = 0
    for i in range(seq_len - q_len, seq_len):
        total += min(i + 1, window) if window else i + 1
    return total


def attn_flops(visible: int) -> int:
    return 4 * visible * HQ * HEAD


def add_flops(rec: dict[str, Any], flops: int, ours_ms: float | None) -> None:
    if "ms" not in rec:
        return
    rec["tflop_s"] = flops / rec["ms"] / 1e9
    if ours_ms:
        rec["ours_speedup"] = rec["ms"] / ours_ms


class PrefillCase:
    """One batch of equal-length prompts, all tokens new, KV already in the paged cache."""

    def __init__(self, run: Run, batch: int, length: int):
        self.batch, self.length = batch, length
        nb = batch * -(-length // PAGE) + 1
        self.cache = rand_cache(nb)
        self.meta = make_meta(
            [length] * batch, [length] * batch, torch.randperm(nb, generator=run.gen), run.dev
        )
        self.q = randn(batch * length, HQ, HEAD)
        self.out = torch.empty_like(self.q)

    def ours(self, **kwargs: Any) -> Callable[[], torch.Tensor]:
        return ours_fn(self.q, self.cache, self.out, self.meta, **kwargs)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qd = self.q.view(self.batch, self.length, HQ, HEAD).transpose(1, 2).contiguous()
        k, v = dense_kv(self.cache, self.meta.bt, self.length)
        return qd, k, v

    def to_tokens(self, out: torch.Tensor) -> torch.Tensor:
        """[B, HQ, L, D] -> [B * L, HQ, D]."""
        return out.transpose(1, 2).reshape(self.batch * self.length, HQ, HEAD)


def prefill_shape(run: Run, batch: int, length: int, with_flex: bool) -> dict[str, Any]:
    rec: dict[str, Any] = {"B": batch, "L": length}
    case = PrefillCase(run, batch, length)
    flops = attn_flops(batch * causal_visible(length, length))
    rec["flops"] = flops
    r, ours_out = measure([case.ours()], graph=False)
    add_flops(r, flops, None)
    rec["ours"] = r
    ours_ms = r.get("ms")
    qd, k, v = case.dense()
    for backend, label in (("FLASH_ATTENTION", "sdpa_flash"), ("CUDNN_ATTENTION", "sdpa_cudnn")):
        r, o = measure([sdpa_fn(backend, qd, k, v, causal=True, gqa=True)], graph=False)
        r["variant"] = "enable_gqa"
        if "error" in r and "finite" not in r:  # refused: K/V expanded to all query heads
            first_error = r["error"]
            ke, ve = k.repeat_interleave(QPK, dim=1), v.repeat_interleave(QPK, dim=1)
            r, o = measure([sdpa_fn(backend, qd, ke, ve, causal=True, gqa=False)], graph=False)
            r.update(variant="kv_expanded", gqa_error=first_error)
            del ke, ve
        add_flops(r, flops, ours_ms)
        if o is not None and ours_out is not None and "error" not in r:
            r["vs_ours"] = rel_err(ours_out, case.to_tokens(o))
        rec[label] = r
        del o
    if with_flex:
        why = flex_allowed(run, "prefill", "flex prefill")
        if why:
            rec["flex"] = {"error": why}
        else:
            try:
                mask = flex_prefill_mask(length, qd.device)
                r, o = measure([flex_fn(qd, k, v, mask)], graph=False)
            except Exception as e:
                r, o = {"error": err_str(e)}, None
            add_flops(r, flops, ours_ms)
            if o is not None and ours_out is not None and "error" not in r:
                r["vs_ours"] = rel_err(ours_out, case.to_tokens(o))
            rec["flex"] = r
    del case, qd, k, v, ours_out
    cleanup()
    return rec


def prefill_line(rec: dict[str, Any]) -> str:
    head = f"prefill B={rec['B']} L={rec['L']:>5}"
    if "error" in rec:
        return f"{head}: ERROR {rec['error']}"
    parts = [f"{head}: ours {fmt_peer(rec['ours'], 'tflop_s')} TFLOP/s"]
    for label in ("sdpa_flash", "sdpa_cudnn", "flex"):
        if label in rec:
            r = rec[label]
            extra = f" (ours {r['ours_speedup']:.2f}x)" if "ours_speedup" in r else ""
            parts.append(f"{label} {fmt_peer(r, 'tflop_s')}{extra}")
    return " | ".join(parts)


def bench_prefill(run: Run) -> None:
    p = run.params
    res: dict[str, Any] = {"shapes": [], "skipped": [], "checks": []}
    run.results["prefill"] = res
    res["checks"].append(ref_check(run, "prefill ragged causal", [700, 1300], [700, 1300]))
    res["checks"].append(ref_check(run, "chunked prefill (context 900)", [1200], [300]))
    run.save()
    flex_shapes = {tuple(s) for s in p["flex_prefill_shapes"]}
    for batch, length in p["prefill_shapes"]:
        if run.left_for("prefill") < 5:
            res["skipped"].append({"B": batch, "L": length, "why": "time budget"})
            run.log(f"prefill B={batch} L={length}: skipped (time budget)")
            continue
        try:
            rec = prefill_shape(run, batch, length, (batch, length) in flex_shapes)
        except Exception as e:
            rec = {"B": batch, "L": length, "error": err_str(e)}
            cleanup()
        res["shapes"].append(rec)
        run.save()
        run.log(prefill_line(rec))


# ---- sliding window --------------------------------------------------------------------------


def bench_window(run: Run) -> None:
    length = run.params["window_len"]
    res: dict[str, Any] = {"L": length, "W": WINDOW, "B": 1, "checks": []}
    run.results["window"] = res
    res["checks"].append(ref_check(run, f"prefill window {WINDOW}", [3000], [3000], window=WINDOW))
    res["checks"].append(
        ref_check(run, f"decode window {WINDOW}", [3000, 900], [1, 1], window=WINDOW)
    )
    run.save()
    case = PrefillCase(run, 1, length)
    full_flops = attn_flops(causal_visible(length, length))
    win_flops = attn_flops(causal_visible(length, length, WINDOW))
    r_full, o_full = measure([case.ours()], graph=False)
    add_flops(r_full, full_flops, None)
    r_win, o_win = measure([case.ours(window=WINDOW)], graph=False)
    add_flops(r_win, win_flops, None)
    res["ours_full"], res["ours_window"] = r_full, r_win
    res["ideal_speedup_tiles"] = length / (2 * WINDOW)
    res["ideal_speedup_exact_keys"] = full_flops / win_flops
    if "ms" in r_full and "ms" in r_win:
        res["speedup"] = r_full["ms"] / r_win["ms"]
        res["pct_of_ideal"] = 100.0 * res["speedup"] / res["ideal_speedup_tiles"]
    res["sdpa"] = {
        "error": "not run: SDPA has no window option; a dense 32k x 32k mask is not a fair peer"
    }
    del o_full
    if run.params["flex_window"]:
        why = flex_allowed(run, "window", "flex window")
        if why:
            res["flex_window"] = {"error": why}
        else:
            try:
                qd, k, v = case.dense()
                rf, _ = measure(
                    [flex_fn(qd, k, v, flex_prefill_mask(length, qd.device))], graph=False
                )
                add_flops(rf, full_flops, r_full.get("ms"))
                rw, ow = measure(
                    [flex_fn(qd, k, v, flex_prefill_mask(length, qd.device, WINDOW))], graph=False
                )
                add_flops(rw, win_flops, r_win.get("ms"))
                if ow is not None and o_win is not None and "error" not in rw:
                    rw["vs_ours"] = rel_err(o_win, case.to_tokens(ow))
                res["flex_full"], res["flex_window"] = rf, rw
                if "ms" in rf and "ms" in rw:
                    res["flex_speedup"] = rf["ms"] / rw["ms"]
                    res["flex_pct_of_ideal"] = (
                        100.0 * res["flex_speedup"] / res["ideal_speedup_tiles"]
                    )
                del qd, k, v
            except Exception as e:
                res["flex_window"] = {"error": err_str(e)}
    else:
        res["flex_window"] = {"error": "not run (flex_window off in this mode)"}
    del case, o_win
    cleanup()
    run.save()
    if "speedup" in res:
        run.log(
            f"window W={WINDOW} L={length}: full {r_full['ms']:.2f} ms, "
            f"window {r_win['ms']:.3f} ms, "
            f"speedup {res['speedup']:.2f}x of ideal {res['ideal_speedup_tiles']:.1f}x "
            f"({res['pct_of_ideal']:.0f}%)"
        )
    else:
        run.log(f"window: ERROR {r_full.get('error') or r_win.get('error')}")


# ---- features: sinks and soft cap ------------------------------------------------------------


def bench_features(run: Run) -> None:
    res: dict[str, Any] = {"checks": []}
    run.results["features"] = res
    sinks = torch.randn(HQ, generator=run.gen).float().to(run.dev)
    lens = [1000, 37, 2500, 4101]
    res["checks"] += [
        ref_check(run, "decode sinks (split)", lens, [1] * 4, sinks=sinks),
        ref_check(run, "decode sinks (no split)", lens, [1] * 4, sinks=sinks, use_plan=False),
        ref_check(run, "decode soft cap (split)", lens, [1] * 4, soft_cap=SOFT_CAP),
        ref_check(run, "prefill sinks", [700, 1300], [700, 1300], sinks=sinks),
        ref_check(run, "prefill soft cap", [700, 1300], [700, 1300], soft_cap=SOFT_CAP),
    ]
    run.save()

    def compare(name: str, make: Callable[..., Callable[[], torch.Tensor]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        # plain, sinks, soft cap, plain again: drift shows as a plain/plain2 gap.
        for key, kwargs in (
            ("plain", {}),
            ("sinks", {"sinks": sinks}),
            ("soft_cap", {"soft_cap": SOFT_CAP}),
            ("plain_again", {}),
        ):
            r, _ = measure([make(**kwargs)], graph=False)
            out[key] = r
        base = [out[k]["ms"] for k in ("plain", "plain_again") if "ms" in out[k]]
        if base:
            out["plain_ms_mean"] = statistics.fmean(base)
            for key in ("sinks", "soft_cap"):
                if "ms" in out[key]:
                    out[f"{key}_overhead_pct"] = 100.0 * (out[key]["ms"] / out["plain_ms_mean"] - 1)
        run.log(
            f"features {name}: plain {out.get('plain_ms_mean', float('nan')) * 1e3:.1f} us, "
            f"sinks {out.get('sinks_overhead_pct', float('nan')):+.1f}%, "
            f"soft cap {out.get('soft_cap_overhead_pct', float('nan')):+.1f}%"
        )
        return out

    batch, ctx = run.params["features_decode"]
    nb = batch * ctx // PAGE + 1
    cache = rand_cache(nb)
    meta = make_meta([ctx] * batch, [1] * batch, torch.randperm(nb, generator=run.gen), run.dev)
    q = randn(batch, HQ, HEAD)
    out = torch.empty_like(q)
    res["decode"] = {
        "B": batch,
        "ctx": ctx,
        "split": plan_dict(meta.plan),
        **compare(f"decode B={batch} ctx={ctx}", functools.partial(ours_fn, q, cache, out, meta)),
    }
    del cache, q, out, meta
    cleanup()
    run.save()
    length = run.params["features_prefill_len"]
    case = PrefillCase(run, 1, length)
    res["prefill"] = {"B": 1, "L": length, **compare(f"prefill L={length}", case.ours)}
    del case
    cleanup()
    run.save()


# ---- split-KV ---------------------------------------------------------------------------------


def bench_split(run: Run) -> None:
    ctx = run.params["split_ctx"]
    res: dict[str, Any] = {"B": 1, "ctx": ctx, "checks": []}
    run.results["split"] = res
    res["checks"].append(ref_check(run, "decode B=1 5000 split plan", [5000], [1]))
    nb = ctx // PAGE + 1
    kv_bytes = ctx * KV_BYTES_PER_TOKEN
    n_rot = rotation_count(kv_bytes)
    caches = [rand_cache(nb) for _ in range(n_rot)]
    meta = make_meta([ctx], [1], torch.randperm(nb, generator=run.gen), run.dev)
    q = randn(1, HQ, HEAD)
    out = torch.empty_like(q)
    nbytes = decode_bytes([ctx])
    res["plan"] = plan_dict(meta.plan)
    res["rotation_buffers"] = n_rot
    r_split, o_split = measure([ours_fn(q, c, out, meta) for c in caches], graph=n_rot > 1)
    add_bw(run, r_split, nbytes, None)
    r_none, o_none = measure(
        [ours_fn(q, c, out, meta, use_plan=False) for c in caches], graph=n_rot > 1
    )
    add_bw(run, r_none, nbytes, None)
    res["with_plan"], res["split_none"] = r_split, r_none
    if o_split is not None and o_none is not None:
        res["with_plan"]["vs_split_none"] = rel_err(o_split, o_none)
    if "ms" in r_split and "ms" in r_none:
        res["speedup"] = r_none["ms"] / r_split["ms"]
        run.log(
            f"split B=1 ctx={ctx}: plan {res['plan']} {r_split['tb_s']:.2f} TB/s, "
            f"split=None {r_none['tb_s']:.2f} TB/s, speedup {res['speedup']:.2f}x"
        )
    del caches, meta, q, out
    cleanup()
    run.save()


# ---- verdicts, report, plot ------------------------------------------------------------------


def kfmt(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _verdict(name: str, target: str, measured: str, met: bool | None, **extra: Any) -> dict:
    return {"name": name, "target": target, "measured": measured, "met": met, **extra}


def verdicts(results: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    shapes = [s for s in results.get("decode", {}).get("shapes", []) if "uniform" in s]

    def tb(s: dict[str, Any], variant: str = "uniform") -> float | None:
        return s.get(variant, {}).get("ours", {}).get("tb_s")

    large = [s for s in shapes if s["kv_gib"] >= TARGETS["decode_large_min_kv_gib"] and tb(s)]
    if large:
        worst = min(large, key=tb)
        vals = [tb(s) for s in large]
        out.append(
            _verdict(
                "decode, KV >= 4 GiB (uniform)",
                f">= {TARGETS['decode_large_tb_s']} TB/s",
                f"worst {tb(worst):.2f} (B={worst['B']} ctx={worst['ctx']}), "
                f"median {statistics.median(vals):.2f} TB/s over {len(vals)} shapes",
                min(vals) >= TARGETS["decode_large_tb_s"],
            )
        )
        skew = [tb(s, "skewed") for s in large if tb(s, "skewed")]
        if skew:
            out.append(
                _verdict(
                    "decode, KV >= 4 GiB (skewed lengths)",
                    f">= {TARGETS['decode_large_tb_s']} TB/s",
                    f"worst {min(skew):.2f}, median {statistics.median(skew):.2f} TB/s",
                    min(skew) >= TARGETS["decode_large_tb_s"],
                )
            )
    mid = [s for s in shapes if s["B"] in (16, 32) and s["ctx"] == 8192 and tb(s)]
    if mid:
        vals = [tb(s) for s in mid]
        out.append(
            _verdict(
                "decode B 16-32, ctx 8k",
                f">= {TARGETS['decode_mid_tb_s']} TB/s",
                ", ".join(f"B={s['B']}: {tb(s):.2f}" for s in mid),
                min(vals) >= TARGETS["decode_mid_tb_s"],
            )
        )
    b1 = [s for s in shapes if s["B"] == 1 and s["ctx"] == 32768 and tb(s)]
    if b1:
        out.append(
            _verdict(
                "decode B=1, ctx 32k",
                f">= {TARGETS['decode_b1_32k_tb_s']} TB/s",
                f"{tb(b1[0]):.2f} TB/s",
                tb(b1[0]) >= TARGETS["decode_b1_32k_tb_s"],
            )
        )
    flex = [
        (s, s["uniform"]["flex_paged"]["ours_speedup"])
        for s in shapes
        if "ours_speedup" in s["uniform"].get("flex_paged", {})
    ]
    if flex:
        big = [x for s, x in flex if s["kv_gib"] >= TARGETS["decode_large_min_kv_gib"]]
        out.append(
            _verdict(
                "decode vs FlexAttention paged (time ratio)",
                f">= {TARGETS['decode_vs_flex_paged']}x (large work)",
                ", ".join(f"B={s['B']} ctx={s['ctx']}: {x:.2f}x" for s, x in flex),
                min(big) >= TARGETS["decode_vs_flex_paged"] if big else None,
            )
        )
    pre = [s for s in results.get("prefill", {}).get("shapes", []) if "ours" in s]
    for label, key, tgt in (
        ("prefill vs SDPA flash", "sdpa_flash", TARGETS["prefill_vs_sdpa_flash"]),
        ("prefill vs SDPA cuDNN (stretch)", "sdpa_cudnn", TARGETS["prefill_vs_sdpa_cudnn_stretch"]),
    ):
        vals = [(s, s[key]["ours_speedup"]) for s in pre if "ours_speedup" in s.get(key, {})]
        if vals:
            out.append(
                _verdict(
                    label,
                    f">= {tgt}x",
                    ", ".join(f"B={s['B']} L={kfmt(s['L'])}: {x:.2f}x" for s, x in vals),
                    min(x for _, x in vals) >= tgt,
                )
            )
    win = results.get("window", {})
    if "pct_of_ideal" in win:
        out.append(
            _verdict(
                f"sliding window W={WINDOW}, L={kfmt(win['L'])} prefill",
                f">= {TARGETS['window_pct_of_ideal']:.0f}% of L/(2W) = "
                f"{win['ideal_speedup_tiles']:.1f}x",
                f"{win['speedup']:.2f}x = {win['pct_of_ideal']:.0f}%",
                win["pct_of_ideal"] >= TARGETS["window_pct_of_ideal"],
            )
        )
    feats = results.get("features", {})
    for where in ("decode", "prefill"):
        shape = feats.get(where, {})
        size = (
            f"B={shape.get('B')} ctx={shape.get('ctx')}"
            if where == "decode"
            else f"L={shape.get('L')}"
        )
        for feat in ("sinks", "soft_cap"):
            key = f"{feat}_overhead_pct"
            if key in shape:
                val = shape[key]
                out.append(
                    _verdict(
                        f"{feat} overhead, {where} {size}",
                        f"<= {TARGETS['feature_overhead_pct']:.0f}%",
                        f"{val:+.1f}%",
                        val <= TARGETS["feature_overhead_pct"],
                    )
                )
    split = results.get("split", {})
    if "speedup" in split:
        out.append(
            _verdict(
                f"split-KV, B=1 ctx {split['ctx']} (plan vs split=None)",
                "plan faster",
                f"{split['with_plan']['tb_s']:.2f} vs {split['split_none']['tb_s']:.2f} TB/s "
                f"({split['speedup']:.2f}x)",
                split["speedup"] > 1.0 if split.get("plan") else None,
            )
        )
    checks = [
        c for sec in SECTIONS for c in results.get(sec, {}).get("checks", []) if isinstance(c, dict)
    ]
    if checks:
        bad = [c["name"] for c in checks if not c.get("ok")]
        out.append(
            _verdict(
                "correctness vs fp32 reference (small shapes)",
                f"max |diff| / max |ref| <= {TOLERANCE}",
                f"{len(checks) - len(bad)}/{len(checks)} ok" + (f"; failed: {bad}" if bad else ""),
                not bad,
            )
        )
    return out


def _status(met: bool | None) -> str:
    return {True: "[green]met[/]", False: "[red]missed[/]", None: "n/a"}[met]


def print_report(run: Run) -> None:
    res = run.results
    con = run.console
    m = res.get("machine", {})
    con.print(
        f"[bold]Attention benchmark[/bold] ({res.get('mode')}) - {m.get('gpu')}, torch "
        f"{m.get('torch_version')}, triton {m.get('triton_version')}, "
        f"{res.get('elapsed_s', 0):.0f} s"
    )
    ceil = res.get("ceilings", {})
    if "copy" in ceil:
        con.print(
            f"Ceilings: copy {ceil['copy']['tb_s']:.2f} TB/s (read + write), bf16 matmul 8192^3 "
            f"{ceil['matmul_bf16_8192']['tflop_s']:.0f} TFLOP/s"
        )
    dec = sorted(res.get("decode", {}).get("shapes", []), key=lambda s: (s["B"], s["ctx"]))
    if dec:
        t = Table(
            title="Decode, 32q/8kv/d128 bf16, page 16: TB/s of bytes read (peers: same bytes / "
            "their time); x = peer time / ours"
        )
        for col in (
            "B", "ctx", "KV GiB", "ours us", "TB/s", "% copy", "skewed", "flash", "cudnn",
            "flex", "flex paged", "x flash", "x paged", "target",
        ):  # fmt: skip
            t.add_column(col, justify="right")
        for s in dec:
            if "uniform" not in s or "tb_s" not in s["uniform"]["ours"]:
                t.add_row(str(s["B"]), str(s["ctx"]), *["-"] * 11, "error")
                continue
            u = s["uniform"]
            o = u["ours"]
            fl = best_peer(u, "sdpa_flash")
            target = ""
            if s["kv_gib"] >= TARGETS["decode_large_min_kv_gib"]:
                target = f">=3.0 {_status(o['tb_s'] >= TARGETS['decode_large_tb_s'])}"
            elif s["B"] in (16, 32) and s["ctx"] == 8192:
                target = f">=2.7 {_status(o['tb_s'] >= TARGETS['decode_mid_tb_s'])}"
            elif s["B"] == 1 and s["ctx"] == 32768:
                target = f">=1.5 {_status(o['tb_s'] >= TARGETS['decode_b1_32k_tb_s'])}"
            fp = u.get("flex_paged")
            t.add_row(
                str(s["B"]),
                str(s["ctx"]),
                f"{s['kv_gib']:.2f}",
                f"{o['ms'] * 1e3:.1f}",
                f"{o['tb_s']:.2f}",
                f"{o.get('pct_of_copy', float('nan')):.0f}",
                fmt_peer(s.get("skewed", {}).get("ours")),
                fmt_peer(fl),
                fmt_peer(best_peer(u, "sdpa_cudnn")),
                fmt_peer(u.get("flex_dense")),
                fmt_peer(fp),
                f"{fl['ours_speedup']:.2f}" if fl and "ours_speedup" in fl else "-",
                f"{fp['ours_speedup']:.2f}" if fp and "ours_speedup" in fp else "-",
                target,
            )
        con.print(t)
    pre = res.get("prefill", {}).get("shapes", [])
    if pre:
        t = Table(title="Prefill causal, 32q/8kv/d128 bf16: TFLOP/s (visible keys only)")
        for col in ("B", "L", "ours", "flash", "cudnn", "flex", "x flash (>=1.2)",
                    "x cudnn (>=0.9)", "x flex", "err vs flash"):  # fmt: skip
            t.add_column(col, justify="right")
        for s in pre:
            if "ours" not in s:
                t.add_row(str(s["B"]), str(s["L"]), *["-"] * 7, "error")
                continue

            def x(key: str, s: dict[str, Any] = s) -> str:
                r = s.get(key, {})
                return f"{r['ours_speedup']:.2f}" if "ours_speedup" in r else "-"

            err = s.get("sdpa_flash", {}).get("vs_ours", {}).get("max_rel_err")
            t.add_row(
                str(s["B"]),
                str(s["L"]),
                fmt_peer(s["ours"], "tflop_s"),
                fmt_peer(s.get("sdpa_flash"), "tflop_s"),
                fmt_peer(s.get("sdpa_cudnn"), "tflop_s"),
                fmt_peer(s.get("flex"), "tflop_s"),
                x("sdpa_flash"),
                x("sdpa_cudnn"),
                x("flex"),
                f"{err:.1e}" if err is not None else "-",
            )
        con.print(t)
    ver = res.get("verdicts", [])
    if ver:
        t = Table(title="Targets (KERNELS_AND_BENCHMARKS.md), all from this run")
        for col in ("target", "bar", "measured", "status"):
            t.add_column(col, justify="left")
        for v in ver:
            t.add_row(
                escape(v["name"]), escape(v["target"]), escape(v["measured"]), _status(v["met"])
            )
        con.print(t)
    if res.get("errors"):
        con.print(f"[red]Errors:[/red] {escape(str(res['errors']))}")


def plot(run: Run) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        run.console.print("[yellow]matplotlib is not installed: skipping the PNG.[/yellow]")
        return False
    res = run.results
    fig, axes = plt.subplots(2, 2, figsize=(15, 10))
    (ax1, ax2), (ax3, ax4) = axes
    dec = [
        s
        for s in res.get("decode", {}).get("shapes", [])
        if "tb_s" in s.get("uniform", {}).get("ours", {})
    ]
    for ctx in sorted({s["ctx"] for s in dec}):
        pts = sorted((s["B"], s["uniform"]["ours"]["tb_s"]) for s in dec if s["ctx"] == ctx)
        ax1.plot(*zip(*pts, strict=True), marker="o", label=f"ours ctx {kfmt(ctx)}")
        sk = sorted(
            (s["B"], s["skewed"]["ours"]["tb_s"])
            for s in dec
            if s["ctx"] == ctx and "tb_s" in s.get("skewed", {}).get("ours", {})
        )
        if sk:
            ax1.plot(
                *zip(*sk, strict=True), marker="x", linestyle=":", color=ax1.lines[-1].get_color()
            )
    if run.copy_tb_s:
        ax1.axhline(run.copy_tb_s, color="black", linestyle="--", label="measured copy")
    ax1.axhline(TARGETS["decode_large_tb_s"], color="red", linestyle=":", label="target >= 4 GiB")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("batch")
    ax1.set_ylabel("TB/s of bytes read")
    ax1.set_title("Decode, ours (dotted x: skewed lengths)")
    ax1.legend(fontsize=7)
    ax1.grid(True, alpha=0.3)

    for label, getter, marker in (
        ("SDPA flash", lambda u: best_peer(u, "sdpa_flash"), "o"),
        ("SDPA cuDNN", lambda u: best_peer(u, "sdpa_cudnn"), "s"),
        ("Flex dense", lambda u: u.get("flex_dense"), "^"),
        ("Flex paged", lambda u: u.get("flex_paged"), "D"),
    ):
        pts = [
            (s["kv_gib"], getter(s["uniform"])["ours_speedup"])
            for s in dec
            if getter(s["uniform"]) and "ours_speedup" in getter(s["uniform"])
        ]
        if pts:
            ax2.scatter(*zip(*pts, strict=True), marker=marker, label=label)
    ax2.axhline(1.0, color="black", linewidth=0.8)
    ax2.axhline(
        TARGETS["decode_vs_flex_paged"], color="red", linestyle=":", label="target vs flex paged"
    )
    ax2.set_xscale("log")
    ax2.set_xlabel("KV GiB")
    ax2.set_ylabel("peer time / ours")
    ax2.set_title("Decode speedup of ours over same-run peers (uniform)")
    ax2.legend(fontsize=7)
    ax2.grid(True, alpha=0.3)

    pre = [s for s in res.get("prefill", {}).get("shapes", []) if "ours" in s]
    for batch, style in zip(sorted({s["B"] for s in pre}), itertools.cycle(("-", "--", ":"))):
        for key, label in (("ours", "ours"), ("sdpa_flash", "SDPA flash"),
                           ("sdpa_cudnn", "SDPA cuDNN"), ("flex", "Flex")):  # fmt: skip
            pts = sorted(
                (s["L"], s[key]["tflop_s"])
                for s in pre
                if s["B"] == batch and "tflop_s" in s.get(key, {})
            )
            if pts:
                ax3.plot(
                    *zip(*pts, strict=True), linestyle=style, marker="o", label=f"{label} B={batch}"
                )
    ax3.set_xscale("log", base=2)
    ax3.set_xlabel("sequence length")
    ax3.set_ylabel("TFLOP/s (causal, visible keys)")
    ax3.set_title("Prefill causal")
    ax3.legend(fontsize=7, ncol=2)
    ax3.grid(True, alpha=0.3)

    ax4.axis("off")
    lines = ["Targets (this run):"]
    for v in res.get("verdicts", []):
        mark = {True: "MET   ", False: "MISSED", None: "n/a   "}[v["met"]]
        lines.append(f"{mark} {v['name']}: {v['measured']} (bar {v['target']})")
    ax4.text(0, 1, "\n".join(_wrap(lines, 110)), va="top", family="monospace", fontsize=7)
    m = res.get("machine", {})
    fig.suptitle(
        f"unified_attn attention benchmark - {m.get('gpu')}, torch {m.get('torch_version')}, "
        f"triton {m.get('triton_version')} ({res.get('mode')})"
    )
    fig.tight_layout()
    fig.savefig(run.png_path, dpi=110)
    plt.close(fig)
    return True


def _wrap(lines: list[str], width: int) -> list[str]:
    out = []
    for line in lines:
        while len(line) > width:
            out.append(line[:width])
            line = "    " + line[width:]
        out.append(line)
    return out


# ---- main ------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Attention kernel benchmark (GPU): ours vs SDPA flash/cuDNN and FlexAttention."
    )
    ap.add_argument("--out", default="benchmarks/results", help="output directory")
    ap.add_argument("--quick", action="store_true", help="a small subset (about 2 minutes)")
    ap.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)} (ceilings always run)",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="soft time budget in seconds: FlexAttention compiles and further shapes are "
        "skipped (and recorded as skipped) once it runs out (default 450 full, 105 quick)",
    )
    ap.add_argument("--no-flex", action="store_true", help="skip the FlexAttention peers")
    ap.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    args = ap.parse_args(argv)
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown or not chosen:
        ap.error(f"--sections: unknown {unknown}; choose from {','.join(SECTIONS)}")
    args.sections = [s for s in SECTIONS if s in chosen]
    return args


def gpu_info() -> dict[str, Any]:
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name,
        "gpu_memory_gib": props.total_memory / GIB,
        "sm_count": props.multi_processor_count,
        "capability": f"{props.major}.{props.minor}",
        "l2_cache_mb": getattr(props, "L2_cache_size", 0) / 1e6,
        "triton_version": triton.__version__,
        "torch_version_full": torch.__version__,
        "cuda_version": torch.version.cuda,
        "cudnn_version": torch.backends.cudnn.version(),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "benchmarks/attention.py needs a CUDA GPU (torch.cuda.is_available() is False); "
            "run it on the GPU machine.",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(2)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print(
            "TRITON_INTERPRET=1 is set: unset it to benchmark the compiled kernels.",
            file=sys.stderr,
        )
        raise SystemExit(2)
    params = dict(QUICK_PARAMS if args.quick else FULL_PARAMS)
    console = Console()
    if not console.is_terminal:
        console = Console(width=180)
    run = Run(args, params, console)
    run.out_dir.mkdir(parents=True, exist_ok=True)
    cmd_args = list(sys.argv[1:] if argv is None else argv)
    run.results.update(
        schema="unified_attn.benchmarks.attention/v1",
        mode="quick" if args.quick else "full",
        command=" ".join(["python", "benchmarks/attention.py", *cmd_args]),
        machine={**machine_info(), **gpu_info()},
        timestamp_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        params={
            **params,
            "sections": args.sections,
            "budget_s": run.budget,
            "no_flex": args.no_flex,
            "heads_q": HQ,
            "heads_kv": HKV,
            "head_size": HEAD,
            "page_size": PAGE,
            "dtype": str(DTYPE),
            "seed": SEED,
            "timer": f"triton.testing.do_bench(warmup={WARMUP_MS}, rep={REP_MS}, median); "
            "CUDA graph over the rotation when the working set < 200 MB",
            "rotation": f"working set < {ROTATE_BELOW / 1e6:.0f} MB: rotate ceil(256 MiB / ws) "
            f"buffers (max {MAX_ROTATE})",
            "decode_bytes": "sum(seq_lens) * Hkv * D * 2 (K, V) * 2 B + Q + output",
            "prefill_flops": "4 * sum over queries of visible keys * Hq * D",
            "tolerance": TOLERANCE,
            "notes": [
                "SDPA decode peers: best of enable_gqa (q [B,32,1,D]) and packed (q [B,8,4,D], "
                "non-causal; the same math); both recorded",
                "FlexAttention paged uses the page size (16) as its KV block size, as torch's "
                "PagedAttention requires; complete pages are full blocks (no mask_mod)",
                "FlexAttention compile time excluded (first call, recorded as first_call_s)",
                "peer TB/s = our bytes model / peer time, so TB/s ratios are time ratios",
            ],
        },
        targets=TARGETS,
        errors=[],
    )
    run.log(
        f"{run.results['machine']['gpu']}, torch {torch.__version__}, mode {run.results['mode']}, "
        f"sections {','.join(args.sections)}, budget {run.budget:.0f} s"
    )
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, _frame: Any) -> None:
        raise Interrupted(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    torch.manual_seed(SEED)
    benches = {
        "decode": bench_decode,
        "prefill": bench_prefill,
        "window": bench_window,
        "features": bench_features,
        "split": bench_split,
    }
    try:
        run.results["ceilings"] = bench_ceilings(run)
        run.save()
        for name in args.sections:
            run.log(f"== {name} ==")
            try:
                benches[name](run)
            except Exception as e:
                run.results["errors"].append({"section": name, "error": err_str(e)})
                run.log(f"{name}: ERROR {err_str(e)}")
                with contextlib.suppress(Exception):
                    cleanup()
            run.save()
    except (Interrupted, KeyboardInterrupt) as e:
        run.results["interrupted"] = err_str(e)
        run.log(f"interrupted ({err_str(e)}): writing partial results")
    finally:
        signal.signal(signal.SIGTERM, previous)
        run.results["verdicts"] = verdicts(run.results)
        run.save()
        print_report(run)
        run.results["png"] = None
        if not args.no_plot:
            try:
                if plot(run):
                    run.results["png"] = str(run.png_path)
            except Exception as e:
                run.results["errors"].append({"section": "plot", "error": err_str(e)})
        run.save()
        console.print(
            f"Wrote {run.json_path}" + (f" and {run.png_path}" if run.results["png"] else "")
        )
    return run.results


if __name__ == "__main__":
    sys.exit(1 if main().get("interrupted") else 0)
