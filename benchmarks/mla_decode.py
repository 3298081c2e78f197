"""MLA decode benchmark: the Triton weight-absorbed MLA kernel (`mla_ops.mla_attention`) over a
paged latent cache, against a torch peer measured in the same run.

    python benchmarks/mla_decode.py [--out DIR] [--heads 128,16] [--batches 1,16,64,128]
                                    [--contexts 1024,8192,32768] [--num-segments N]
                                    [--tiles BH,BQ,BN,WARPS,STAGES[,PROGRAMS_PER_SM]]
                                    [--no-peers] [--no-plot] [--quick]

Shapes: DeepSeek-V3 decode, H query heads (128, or 16 per rank at TP=8), kv_lora_rank L=512, rope
R=64, page 64, bf16, one query token per request, every request `ctx` tokens long, random data
in a randomly permuted paged cache, softmax scale 192^-0.5.

* ceilings, measured in the same run by the attention benchmark's helper
  (`attn_bench.sections.bench_ceilings`): device-to-device copy bandwidth (read + write) and a
  bf16 8192^3 matmul.
* ours: `plan_mla` (split-KV chosen automatically unless `--num-segments`), the scratch ensured
  before timing, tiles from `mla_tiles` unless `--tiles` (several `--tiles` compare configs).
  Latent bytes = sum over requests of seq_len * (L + R) * 2 (TB/s and % of the copy
  bandwidth); TFLOP/s = 2 * H * (2L + R) * sum(seq_len) (% of the matmul).
* peers (same run, same data): `gather + SDPA`, the paged path in plain torch (gather each
  request's pages into a dense [B, ctx, L + R] tensor, then `scaled_dot_product_attention` with
  the heads as query rows of the one latent KV head: q [B, 1, H, L + R], k [B, 1, ctx, L + R],
  v = k[..., :L]); and `SDPA dense`, the same SDPA on a pre-gathered copy (reads what ours reads).
  FlexAttention is not a peer yet (not tried: its kernels would pad the 576-wide head to 1024).
* checks: ours against a float32 torch oracle at a small ragged shape, and against each peer's
  output at every timed shape (max |diff| / max |ref| <= 2e-2).

Timing: `triton.testing.do_bench` medians through `attn_bench.timing.measure` (buffers rotated
and captured in a CUDA graph when the working set is under 200 MB). Writes `DIR/mla_decode.json`
(rewritten after every shape) and `DIR/mla_decode.png`.

`--quick` is a smoke run at tiny float32 shapes (H 16, L 64, R 16, page 16); without CUDA it runs
in Triton's interpreter with wall-clock medians, and its numbers say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from common import (
    add_out_argument,
    command_line,
    make_console,
    output_dir,
    pyplot,
    save_figure,
    table,
    utc_timestamp,
    write_json,
)

from unified_attn.harness.bench import machine_info

SCHEMA = "unified_attn.benchmarks.mla_decode/v1"
TARGET_TB_S = 2.5  # latent bytes, B 64, ctx 8k, H 128 (KERNELS_AND_BENCHMARKS.md)
TOLERANCE = 2e-2  # max |diff| / max |ref|
SEED = 1234

FULL: dict[str, Any] = {
    "heads": [128, 16],
    "batches": [64, 1, 16, 128],  # the target's batch first
    "contexts": [8192, 1024, 32768],
    "kv_lora_rank": 512,
    "rope_dim": 64,
    "page": 64,
    "dtype": "bfloat16",
    "scale": 192**-0.5,
}
QUICK: dict[str, Any] = {
    **FULL,
    "heads": [16],
    "batches": [1, 2],
    "contexts": [64, 160],
    "kv_lora_rank": 64,
    "rope_dim": 16,
    "page": 16,
    "dtype": "float32",
}


# ---- arguments and environment -----------------------------------------------------------------


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_argument(ap)
    ap.add_argument(
        "--quick", action="store_true", help="smoke run, tiny shapes (CPU: interpreter)"
    )
    ap.add_argument("--heads", type=int_list, help="query heads, comma-separated")
    ap.add_argument("--batches", type=int_list, help="batch sizes, comma-separated")
    ap.add_argument("--contexts", type=int_list, help="context lengths, comma-separated")
    ap.add_argument(
        "--tiles",
        action="append",
        type=int_list,
        metavar="BH,BQ,BN,WARPS,STAGES[,PROGRAMS_PER_SM]",
        help="tile config(s) to time instead of the default (repeatable)",
    )
    ap.add_argument(
        "--num-segments",
        type=int,
        default=None,
        help="force the split-KV segment count (default: plan_mla decides)",
    )
    ap.add_argument("--no-peers", action="store_true", help="time ours only")
    ap.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    args = ap.parse_args(argv)
    params = dict(QUICK if args.quick else FULL)
    for key in ("heads", "batches", "contexts"):
        if getattr(args, key):
            params[key] = getattr(args, key)
    for tiles in args.tiles or []:
        if len(tiles) not in (5, 6):
            ap.error(f"--tiles takes BH,BQ,BN,WARPS,STAGES[,PROGRAMS_PER_SM], got {tiles}")
    args.params = params
    args.argv = argv
    return args


def require_device(quick: bool) -> torch.device:
    """CUDA for a real run (exit code 2 without it); the CPU interpreter for `--quick`."""
    if quick:
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
            return torch.device("cpu")
        return torch.device("cuda")
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1":
        print(
            "benchmarks/mla_decode.py needs a CUDA GPU without TRITON_INTERPRET=1; use --quick "
            "for a CPU smoke run.",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(2)
    return torch.device("cuda")


# ---- timing ----------------------------------------------------------------------------------


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


# ---- one shape ---------------------------------------------------------------------------------


class Shape:
    """Random latent caches (one per rotation buffer), a permuted block table and the queries of
    B requests of `ctx` tokens and H heads; every tile config and peer reads this same data."""

    def __init__(
        self, bench: Bench, p: dict[str, Any], heads: int, batch: int, ctx: int,
        gen: torch.Generator,
    ) -> None:  # fmt: skip
        dev, self.dtype = bench.device, getattr(torch, p["dtype"])
        self.L, self.R, self.page, self.scale = (p["kv_lora_rank"], p["rope_dim"], p["page"],
                                                 p["scale"])  # fmt: skip
        self.heads, self.batch, self.ctx = heads, batch, ctx
        dim = self.L + self.R
        self.latent_bytes = batch * ctx * dim * self.dtype.itemsize
        pages = -(-ctx // self.page)
        num_blocks = batch * pages + 1  # block 0: the null block
        perm = torch.randperm(batch * pages, generator=gen) + 1
        self.block_table = perm.view(batch, pages).to(torch.int32).to(dev)
        self.rotations = bench.rotations(self.latent_bytes)
        self.caches = [
            self.randn(num_blocks, self.page, dim, device=dev) for _ in range(self.rotations)
        ]
        self.q = self.randn(batch, heads, dim, device=dev)
        self.out = torch.empty(batch, heads, self.L, dtype=self.dtype, device=dev)
        self.qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)

    def plan(self, tiles: Any, num_segments: int | None) -> tuple[Any, Any]:
        """Our plan for this batch and a scratch ensured for it."""
        from unified_attn.backends.triton.mla_ops import MLAScratch, plan_mla

        plan = plan_mla(
            num_reqs=self.batch, num_tokens=self.batch, num_heads=self.heads, max_query_len=1,
            max_seq_len=self.ctx, dtype=self.dtype, device=self.q.device, tiles=tiles,
            num_segments=num_segments,
        )  # fmt: skip
        scratch = MLAScratch()
        if plan.split is not None:
            scratch.ensure(self.batch, self.heads, plan.split.num_segments, self.L, self.q.device)
        return plan, scratch

    def randn(self, *shape: int, device: torch.device) -> torch.Tensor:
        return torch.randn(*shape, device=device).to(self.dtype)

    def ours(self, cache: torch.Tensor, plan: Any, scratch: Any) -> Callable[[], torch.Tensor]:
        from unified_attn.backends.triton.mla_ops import mla_attention

        return functools.partial(
            mla_attention, self.q, cache, self.block_table, self.qsl, self.seq_lens, self.scale,
            self.out, self.L, plan=plan, scratch=scratch,
        )  # fmt: skip

    def gather(self, cache: torch.Tensor) -> torch.Tensor:
        """Each request's pages as a dense `[B, ctx, L + R]` tensor."""
        return cache[self.block_table].flatten(1, 2)[:, : self.ctx]

    def sdpa(self, dense: torch.Tensor) -> torch.Tensor:
        """Heads as the query rows of the single latent KV head: `[B, H, L]`."""
        import torch.nn.functional as F

        k = dense[:, None]  # [B, 1, ctx, L + R]
        q = self.q[:, None]  # [B, 1, H, L + R]
        return F.scaled_dot_product_attention(q, k, k[..., : self.L], scale=self.scale)[:, 0]

    def peers(self, dense_copies: bool) -> dict[str, list[Callable[[], torch.Tensor]]]:
        calls = {
            "gather_sdpa": [
                functools.partial(lambda c: self.sdpa(self.gather(c)), c) for c in self.caches
            ]
        }
        if dense_copies:
            dense = [self.gather(c).contiguous() for c in self.caches]
            calls["sdpa_dense"] = [functools.partial(self.sdpa, d) for d in dense]
        return calls

    def flops(self) -> int:
        return 2 * self.heads * (2 * self.L + self.R) * self.batch * self.ctx


def plan_record(plan: Any) -> dict[str, Any]:
    t = plan.tiles
    return {
        "tiles": [t.block_h, t.block_q, t.block_n, t.num_warps, t.num_stages, t.programs_per_sm],
        "num_segments": plan.split.num_segments if plan.split else 1,
        "segment": plan.split.segment if plan.split else None,
    }


def add_rates(
    rec: dict[str, Any],
    shape: Shape,
    bench: Bench,
    ceilings: dict[str, Any],
    ours_ms: float | None = None,
) -> None:
    if "ms" not in rec:
        return
    rec["tb_s"] = shape.latent_bytes / rec["ms"] / 1e9
    rec["tflop_s"] = shape.flops() / rec["ms"] / 1e9
    if bench.copy_tb_s:
        rec["pct_of_copy"] = 100.0 * rec["tb_s"] / bench.copy_tb_s
    matmul = ceilings.get("matmul_bf16_8192", {}).get("tflop_s")
    if matmul:
        rec["pct_of_matmul"] = 100.0 * rec["tflop_s"] / matmul
    if ours_ms:
        rec["ours_speedup"] = rec["ms"] / ours_ms  # > 1: ours is faster


def bench_shape(
    bench: Bench,
    args: argparse.Namespace,
    ceilings: dict[str, Any],
    heads: int,
    batch: int,
    ctx: int,
    gen: torch.Generator,
) -> dict[str, Any]:
    from unified_attn.backends.triton.mla_ops import MLATiles

    p = args.params
    configs = [MLATiles(*t) for t in args.tiles] if args.tiles else [None]
    rec: dict[str, Any] = {"heads": heads, "batch": batch, "ctx": ctx, "ours": []}
    shape = Shape(bench, p, heads, batch, ctx, gen)
    ours_out = None
    for tiles in configs:
        plan, scratch = shape.plan(tiles, args.num_segments)
        try:
            r, out = bench.measure([shape.ours(c, plan, scratch) for c in shape.caches])
            add_rates(r, shape, bench, ceilings)
            ours_out = out if ours_out is None else ours_out
        except Exception as e:  # a tile config that does not compile is recorded, not fatal
            r = {"error": f"{type(e).__name__}: {e}"[:400]}
        rec["ours"].append({**plan_record(plan), **r})
        del scratch
    best = min((r for r in rec["ours"] if "ms" in r), key=lambda r: r["ms"], default={})
    rec.update(latent_bytes=shape.latent_bytes, rotation_buffers=shape.rotations, best=best)
    if not args.no_peers and ours_out is not None:
        dense_fits = not bench.gpu or 3 * shape.latent_bytes < free_bytes()
        for name, calls in shape.peers(dense_fits).items():
            try:
                r, out = bench.measure(calls)
                add_rates(r, shape, bench, ceilings, best.get("ms"))
                r["vs_ours"] = rel_err(ours_out, out)
            except Exception as e:  # a peer that cannot run this shape is recorded, not fatal
                r = {"error": f"{type(e).__name__}: {e}"[:400]}
            rec[name] = r
    del shape
    if bench.gpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return rec


def free_bytes() -> int:
    free, _ = torch.cuda.mem_get_info()
    return int(free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated())


def oracle_check(bench: Bench, p: dict[str, Any], gen: torch.Generator) -> dict[str, Any]:
    """Ours against a float32 torch oracle: 3 ragged decode requests, H 16, auto plan."""
    from unified_attn.backends.triton.mla_ops import MLAScratch, mla_attention, plan_mla

    dev, dtype = bench.device, getattr(torch, p["dtype"])
    L, dim, page, heads = p["kv_lora_rank"], p["kv_lora_rank"] + p["rope_dim"], p["page"], 16
    lens = [3 * page + 5, 1, 7 * page] if bench.gpu else [page + 3, 1, 2 * page]
    pages = [-(-n // page) for n in lens]
    cache = torch.randn(sum(pages) + 1, page, dim, generator=gen).to(dtype).to(dev)
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    ids = (torch.randperm(sum(pages), generator=gen) + 1).tolist()
    for i, n in enumerate(pages):
        table[i, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype).to(dev)
    out = torch.empty(len(lens), heads, L, dtype=dtype, device=dev)
    plan = plan_mla(
        num_reqs=3,
        num_tokens=3,
        num_heads=heads,
        max_query_len=1,
        max_seq_len=max(lens),
        dtype=dtype,
        device=dev,
    )
    scratch = MLAScratch()
    if plan.split is not None:
        scratch.ensure(3, heads, plan.split.num_segments, L, dev)
    table = table.to(dev)
    mla_attention(
        q,
        cache,
        table,
        torch.arange(4, dtype=torch.int32, device=dev),
        torch.tensor(lens, dtype=torch.int32, device=dev),
        p["scale"],
        out,
        L,
        plan=plan,
        scratch=scratch,
    )
    want = torch.empty(out.shape, dtype=torch.float32, device=dev)
    for i, n in enumerate(lens):
        pos = torch.arange(n, device=dev)
        keys = cache[table[i, pos // page].long(), pos % page].float()  # [n, L + R]
        probs = torch.softmax(q[i].float() @ keys.T * p["scale"], dim=-1)
        want[i] = probs @ keys[:, :L]
    return {"lens": lens, "plan": plan_record(plan), **rel_err(out, want)}


def compiled_kernels() -> list[dict[str, Any]]:
    """Registers, spills and shared memory of every compiled variant of our kernel (read off
    Triton's per-device cache: tuning evidence, empty if that internal layout changes)."""
    from unified_attn.backends.triton.kernels.mla_attention import mla_attention_kernel

    try:
        cache = mla_attention_kernel.device_caches[torch.cuda.current_device()][0]
        return [
            {"constants": constexprs(kern),
             "n_regs": kern.n_regs, "n_spills": kern.n_spills,
             "shared_bytes": kern.metadata.shared, "num_warps": kern.metadata.num_warps,
             "num_stages": kern.metadata.num_stages,
             "wgmma": kern.asm["ptx"].count("wgmma.mma_async"),
             "mma_sync": kern.asm["ptx"].count("mma.sync")}
            for kern in cache.values()
        ]  # fmt: skip
    except Exception as e:
        return [{"error": f"{type(e).__name__}: {e}"[:200]}]


def constexprs(kern: Any) -> dict[str, str]:
    names = kern.src.fn.arg_names
    return {names[k[0]]: str(v) for k, v in kern.src.constants.items() if names[k[0]].isupper()}


# ---- report -----------------------------------------------------------------------------------


def verdicts(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for s in results["shapes"]:
        if (s["heads"], s["batch"], s["ctx"]) == (128, 64, 8192) and "tb_s" in s["best"]:
            out.append(
                {
                    "name": "MLA decode, H 128, B 64, ctx 8k, latent bytes",
                    "target": f">= {TARGET_TB_S} TB/s",
                    "measured": s["best"]["tb_s"],
                    "met": s["best"]["tb_s"] >= TARGET_TB_S,
                }
            )
    checks = [results["oracle_check"]] + [
        s[k]["vs_ours"]
        for s in results["shapes"]
        for k in ("gather_sdpa", "sdpa_dense")
        if "vs_ours" in s.get(k, {})
    ]
    bad = sum(not c["ok"] for c in checks)
    out.append(
        {
            "name": "outputs vs oracle and peers",
            "target": f"rel err <= {TOLERANCE}",
            "measured": f"{len(checks) - bad}/{len(checks)} ok",
            "met": bad == 0,
        }
    )
    return out


def fmt(rec: dict[str, Any], key: str, spec: str = ".2f") -> str:
    return format(rec[key], spec) if key in rec else rec.get("error", "-")[:30]


def print_table(results: dict[str, Any]) -> None:
    cols = [
        "H",
        "B",
        "ctx",
        "split",
        "ours us",
        "TB/s",
        "% copy",
        "TFLOP/s",
        "gather+SDPA us",
        "x",
        "SDPA dense us",
        "x",
    ]
    t = table("MLA decode (latent bytes)", cols)
    for s in results["shapes"]:
        b, g, d = s["best"], s.get("gather_sdpa", {}), s.get("sdpa_dense", {})
        us = {
            k: f"{r['ms'] * 1e3:.1f}" if "ms" in r else "-"
            for k, r in (("b", b), ("g", g), ("d", d))
        }
        t.add_row(
            str(s["heads"]),
            str(s["batch"]),
            str(s["ctx"]),
            str(b.get("num_segments")),
            us["b"],
            fmt(b, "tb_s"),
            fmt(b, "pct_of_copy", ".0f"),
            fmt(b, "tflop_s", ".0f"),
            us["g"],
            fmt(g, "ours_speedup"),
            us["d"],
            fmt(d, "ours_speedup"),
        )
    console = make_console(160)
    console.print(t)
    for v in results["verdicts"]:
        console.print(
            f"{v['name']}: {v['measured']} (target {v['target']}): "
            f"{'met' if v['met'] else 'missed'}"
        )


def plot(results: dict[str, Any], path: Path) -> bool:
    plt = pyplot(make_console(120))
    if plt is None:
        return False
    heads = sorted({s["heads"] for s in results["shapes"]}, reverse=True)
    fig, axes = plt.subplots(1, len(heads), figsize=(7 * len(heads), 5), squeeze=False)
    copy = results["ceilings"]["copy"]["tb_s"]
    for ax, h in zip(axes[0], heads, strict=True):
        shapes = [s for s in results["shapes"] if s["heads"] == h]
        for ctx in sorted({s["ctx"] for s in shapes}):
            for key, style in (("best", "-o"), ("gather_sdpa", ":x")):
                pts = sorted(
                    (s["batch"], s[key]["tb_s"])
                    for s in shapes
                    if s["ctx"] == ctx and "tb_s" in s.get(key, {})
                )
                if pts:
                    label = f"{'ours' if key == 'best' else 'gather+SDPA'} ctx {ctx}"
                    ax.plot(*zip(*pts, strict=True), style, label=label)
        ax.axhline(copy, color="black", linestyle="--", label="measured copy")
        if h == 128:
            ax.axhline(TARGET_TB_S, color="red", linestyle=":", label="target (B 64, 8k)")
        ax.set(
            xscale="log", xlabel="batch", ylabel="TB/s of latent bytes", title=f"MLA decode, H {h}"
        )
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
    m = results["machine"]
    fig.suptitle(f"MLA decode - {m.get('gpu', m.get('cpu_model'))} ({results['mode']})")
    save_figure(fig, path, dpi=110)
    return True


# ---- main -------------------------------------------------------------------------------------


def header(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    machine = machine_info()
    if device.type == "cuda":
        from attn_bench.cli import gpu_info

        machine.update(gpu_info())
    return {
        "schema": SCHEMA,
        "mode": "quick" if args.quick else "full",
        "command": command_line("mla_decode.py", args.argv),
        "machine": machine,
        "timestamp_utc": utc_timestamp(),
        "params": {
            **args.params,
            "tiles": args.tiles,
            "num_segments": args.num_segments,
            "latent_bytes": "sum(seq_len) * (L + R) * dtype bytes",
            "flops": "2 * H * (2L + R) * sum(seq_len)",
            "tolerance": TOLERANCE,
            "seed": SEED,
        },
        "target_tb_s": TARGET_TB_S,
        "shapes": [],
        "errors": [],
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = require_device(args.quick)
    bench = Bench(device)
    out_dir = output_dir(args)
    results = header(args, device)
    json_path = out_dir / "mla_decode.json"
    gen = torch.Generator().manual_seed(SEED)
    torch.manual_seed(SEED)
    results["ceilings"] = bench.ceilings()
    results["oracle_check"] = oracle_check(bench, args.params, gen)
    write_json(json_path, results)
    p = args.params
    for heads in p["heads"]:
        for batch in p["batches"]:
            for ctx in p["contexts"]:
                try:
                    rec = bench_shape(bench, args, results["ceilings"], heads, batch, ctx, gen)
                    results["shapes"].append(rec)
                    bench.log(shape_line(rec))
                except Exception as e:
                    results["errors"].append(
                        {"shape": [heads, batch, ctx], "error": f"{type(e).__name__}: {e}"[:800]}
                    )
                    bench.log(f"H={heads} B={batch} ctx={ctx}: ERROR {e}")
                write_json(json_path, results)
    results["verdicts"] = verdicts(results)
    if bench.gpu:
        results["compiled"] = compiled_kernels()
        for k in results["compiled"]:
            bench.log(f"compiled: {k}")
    results["png"] = None
    if not args.no_plot and results["shapes"] and plot(results, out_dir / "mla_decode.png"):
        results["png"] = str(out_dir / "mla_decode.png")
    write_json(json_path, results)
    print_table(results)
    return results


def shape_line(rec: dict[str, Any]) -> str:
    b = rec["best"]
    peer = rec.get("gather_sdpa", {})
    return (
        f"H={rec['heads']} B={rec['batch']} ctx={rec['ctx']}: tiles {b.get('tiles')} "
        f"segments {b.get('num_segments')}: {b.get('ms', float('nan')) * 1e3:.1f} us, "
        f"{b.get('tb_s', float('nan')):.2f} TB/s, {b.get('tflop_s', float('nan')):.0f} TFLOP/s;"
        f" gather+SDPA {peer.get('ms', float('nan')) * 1e3:.1f} us"
    )


if __name__ == "__main__":
    main()
