"""fp8 KV-cache decode benchmark: the Triton unified kernel over a bfloat16 cache and over an
fp8 (e4m3) cache of the same requests, in the same run.

    python benchmarks/fp8_decode.py [--out DIR] [--batches 64,16,1] [--contexts 32768,8192]
                                    [--quick]

Shape: 32 query heads / 8 KV heads / head size 128, page 16, bfloat16 queries, one query token
per request, every request `ctx` tokens long, random data (unit normal keys and values) on a
randomly permuted paged cache. The fp8 cache holds the same keys and values quantized with
their calibrated scales (amax / 448). Per (batch, ctx) and cache dtype: the decode attention
launch (split-KV as the backend plans it) timed by `triton.testing.do_bench` (median, L2
flushed before every call), as ms, decode tokens/s (batch / ms) and TB/s of bytes read
(K + V of the cache dtype + Q + output). Each row reports `fp8_over_bf16`, the tokens/s ratio
(target >= 1.8 at B 64, ctx 32k, KERNELS_AND_BENCHMARKS.md), and `fp8_vs_bf16`, max |fp8 out
- bf16 out| / max |bf16 out| (the quantization error, a few percent). An oracle check compares
the fp8 kernel with the reference attention over the dequantized cache at a small ragged shape.

Writes `DIR/fp8_decode.json` (rewritten after every shape). `--quick` is a smoke run at tiny
float16 shapes; without CUDA it runs in Triton's interpreter with wall-clock medians, and its
numbers say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from common import (
    add_out_argument,
    command_line,
    machine_info,
    output_dir,
    utc_timestamp,
    write_json,
)

SCHEMA = "unified_attn.benchmarks.fp8_decode/v1"
TARGET_RATIO = 1.8  # fp8 / bf16 decode tokens/s at B 64, ctx 32k
TARGET_SHAPE = (64, 32768)
ORACLE_TOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
FULL: dict[str, Any] = {"batches": [64, 16, 1], "contexts": [32768, 8192], "dtype": "bfloat16",
                        "heads": 32, "kv_heads": 8, "head_size": 128, "page": 16}  # fmt: skip
QUICK: dict[str, Any] = {**FULL, "batches": [2], "contexts": [48], "dtype": "float16",
                         "heads": 4, "kv_heads": 2, "head_size": 32}  # fmt: skip


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_out_argument(ap)
    ap.add_argument(
        "--quick", action="store_true", help="smoke run, tiny shapes (CPU: interpreter)"
    )
    ap.add_argument("--batches", type=int_list, help="batch sizes, comma-separated")
    ap.add_argument("--contexts", type=int_list, help="context lengths, comma-separated")
    args = ap.parse_args(argv)
    args.params = dict(QUICK if args.quick else FULL)
    for key in ("batches", "contexts"):
        if getattr(args, key):
            args.params[key] = getattr(args, key)
    args.argv = argv
    return args


def require_device(quick: bool) -> torch.device:
    """CUDA for a real run (exit code 2 without it); the CPU interpreter for `--quick`."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return torch.device("cuda")
    if quick:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
        return torch.device("cpu")
    print("benchmarks/fp8_decode.py needs a CUDA GPU without TRITON_INTERPRET=1; use --quick for "
          "a CPU smoke run.", file=sys.stderr, flush=True)  # fmt: skip
    raise SystemExit(2)


def time_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Median ms per call: `do_bench` on the GPU, wall clock in the interpreter."""
    if device.type == "cuda":
        from common import gpu_ms

        return gpu_ms(fn)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


class Decode:
    """B requests of `ctx` tokens on a permuted paged cache, bf16 and fp8 copies of the same
    keys and values, and the decode launch over either."""

    def __init__(self, p: dict[str, Any], batch: int, ctx: int, device: torch.device) -> None:
        from unified_attn.backends.kv_quant import calibrated_scale, quantize_fp8

        gen = torch.Generator(device=device).manual_seed(batch * 100003 + ctx)
        self.p, self.batch, self.ctx, self.device = p, batch, ctx, device
        self.dtype = getattr(torch, p["dtype"])
        hkv, d, page = p["kv_heads"], p["head_size"], p["page"]
        pages = -(-ctx // page)
        self.table = (
            (torch.randperm(batch * pages, generator=gen, device=device) + 1)
            .view(batch, pages)
            .int()
        )
        shape = (batch * pages + 1, 2, page, hkv, d)  # block 0: the null block
        wide = torch.randn(shape, generator=gen, device=device, dtype=self.dtype)
        self.scales = torch.stack([calibrated_scale(wide[:, i]) for i in (0, 1)])
        fp8 = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
        for start in range(0, shape[0], 4096):  # in chunks: the float32 temporaries stay small
            for i in (0, 1):
                part = wide[start : start + 4096, i]
                fp8[start : start + 4096, i] = quantize_fp8(part, self.scales[i])
        self.caches = {"bf16": wide, "fp8": fp8}
        self.q = torch.randn(batch, p["heads"], d, generator=gen, device=device).to(self.dtype)
        self.qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)

    def launch(self, kind: str) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
        from unified_attn.backends.triton import ops

        cache, out = self.caches[kind], torch.empty_like(self.q)
        split = ops.plan_split(max_query_len=1, max_seq_len=self.ctx, num_reqs=self.batch,
                               num_kv_heads=self.p["kv_heads"], device=self.device)  # fmt: skip
        scratch = ops.SplitScratch()

        def run() -> torch.Tensor:
            return ops.unified_attention(
                self.q, cache[:, 0], cache[:, 1], out, query_start_loc=self.qsl,
                seq_lens=self.seq_lens, block_table=self.table, num_seqs=self.batch,
                max_query_len=1, scale=self.p["head_size"] ** -0.5, split=split,
                scratch=scratch, kv_scales=self.scales if kind == "fp8" else None,
            )  # fmt: skip

        return run, out

    def bytes_read(self, kind: str) -> int:
        item = 1 if kind == "fp8" else self.dtype.itemsize
        kv = self.batch * self.ctx * 2 * self.p["kv_heads"] * self.p["head_size"] * item
        return kv + 2 * self.q.numel() * self.dtype.itemsize


def bench_shape(p: dict[str, Any], batch: int, ctx: int, device: torch.device) -> dict[str, Any]:
    """Both cache dtypes of one shape: timings, rates, the ratio and the fp8 error."""
    shape = Decode(p, batch, ctx, device)
    row: dict[str, Any] = {"batch": batch, "ctx": ctx}
    outs = {}
    for kind in ("bf16", "fp8"):
        run, outs[kind] = shape.launch(kind)
        run()  # compile and check before timing
        ms = time_ms(run, device)
        row[kind] = {"ms": ms, "tokens_per_s": batch / ms * 1e3,
                     "tb_s": shape.bytes_read(kind) / ms / 1e9,
                     "finite": bool(torch.isfinite(outs[kind]).all())}  # fmt: skip
    row["fp8_over_bf16"] = row["fp8"]["tokens_per_s"] / row["bf16"]["tokens_per_s"]
    diff = (outs["fp8"].float() - outs["bf16"].float()).abs().max()
    row["fp8_vs_bf16"] = (diff / outs["bf16"].float().abs().max()).item()
    return row


def oracle_check(p: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The fp8 kernel against the reference attention over the dequantized cache, two
    requests of different lengths (one decode token each)."""
    from unified_attn.backend import LayerConfig
    from unified_attn.backends.kv_quant import dequantize_fp8
    from unified_attn.backends.reference import attend

    shape = Decode(p, 2, 40, device)
    shape.seq_lens[1] = 17
    run, out = shape.launch("fp8")
    run()
    layer = LayerConfig(
        "l", p["heads"], p["kv_heads"], p["head_size"], scale=p["head_size"] ** -0.5
    )
    worst = 0.0
    for i, n in enumerate(shape.seq_lens.tolist()):
        pos = torch.arange(n, device=device)
        blocks, offsets = shape.table[i, pos // p["page"]].long(), pos % p["page"]
        k, v = (
            dequantize_fp8(shape.caches["fp8"][blocks, j, offsets], shape.scales[j]) for j in (0, 1)
        )
        expected = attend(layer, shape.q[i : i + 1].float(), k, v, n - 1)
        worst = max(worst, (out[i : i + 1].float() - expected).abs().max().item())
    return {
        "max_abs_err": worst,
        "tol": ORACLE_TOL[shape.dtype],
        "ok": worst <= ORACLE_TOL[shape.dtype],
    }


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The target: fp8 / bf16 tokens/s >= 1.8 at B 64, ctx 32k (None when not measured)."""
    row = next((r for r in rows if (r["batch"], r["ctx"]) == TARGET_SHAPE), None)
    ratio = None if row is None else row["fp8_over_bf16"]
    return {"target": f">= {TARGET_RATIO}x tokens/s at B {TARGET_SHAPE[0]}, ctx {TARGET_SHAPE[1]}",
            "ratio": ratio, "met": None if ratio is None else ratio >= TARGET_RATIO}  # fmt: skip


def print_rows(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        print(f"[fp8_decode] B {r['batch']:>3} ctx {r['ctx']:>6}: bf16 {r['bf16']['ms']:.3f} ms "
              f"({r['bf16']['tb_s']:.2f} TB/s), fp8 {r['fp8']['ms']:.3f} ms "
              f"({r['fp8']['tb_s']:.2f} TB/s): fp8/bf16 tokens/s {r['fp8_over_bf16']:.2f}x, "
              f"error {r['fp8_vs_bf16']:.3g}", flush=True)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = require_device(args.quick)
    p = args.params
    results: dict[str, Any] = {
        "schema": SCHEMA, "mode": "quick" if args.quick else "full",
        "command": command_line("fp8_decode.py", args.argv), "machine": machine_info(),
        "timestamp_utc": utc_timestamp(), "device": str(device), "params": p,
        "oracle_check": oracle_check(p, device), "shapes": [], "errors": [],
    }  # fmt: skip
    path = output_dir(args) / "fp8_decode.json"
    for batch in p["batches"]:
        for ctx in p["contexts"]:
            try:
                results["shapes"].append(bench_shape(p, batch, ctx, device))
            except torch.OutOfMemoryError as error:
                results["errors"].append(f"B {batch} ctx {ctx}: {error}")
            results["verdict"] = verdict(results["shapes"])
            write_json(path, results)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print_rows(results["shapes"])
    print(f"[fp8_decode] {results['verdict']} -> {path}", flush=True)
    return results


if __name__ == "__main__":
    main()
