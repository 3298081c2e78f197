"""The kernel targets on one GPU: decode at small batches, page 64 and the gpt-oss shape, and
causal prefill at pages 16 and 64, each against peers measured in the same run.

    python benchmarks/kernel_targets.py [--out DIR] [--sections decode,prefill]
                                        [--shapes b1-4k,gpt-oss] [--sweep]

Decode shapes (bf16, one query token per request, every request `ctx` tokens, random data on a
randomly permuted paged cache; `SHAPES` below): 32 query / 8 KV heads of 128 at pages 16 and 64
(one with a 4k sliding window at 32k), and gpt-oss's attention (64 query / 8 KV heads of 64,
sliding window 128, learned sinks). A windowed shape allocates only the pages its window touches;
the block table sends the rest to the null block, which the kernel never reads. Timing: the launch
as the backend makes it (split-KV from `plan_split`) captured in a CUDA graph, as the engine runs
decode, over enough distinct caches (at least two) that L2 (50 MB) holds none of them between calls
(`attn_bench.timing`); the graph's median time divided by its calls. Bytes read = K + V of the
visible keys + Q + output; TB/s is that over the time, also as a fraction of the device copy
bandwidth measured in the same run. Peers: SDPA (flash and cuDNN) over dense contiguous K/V of the
same visible keys (not for the gpt-oss shape: SDPA has no sinks), timed the same way; our output is
checked against theirs and against a float32 oracle. `--sweep` also times split counts and tiles
(`TILE`, warps, stages) per decode shape and prints the best next to the shipped choice (in the
JSON under `sweep`).

Prefill: one causal sequence of 2k-32k tokens (32q/8kv/d128, bf16) on a permuted paged cache of
16- and 64-token pages, and a chunked prefill of 512 queries after 32k cached keys; TFLOP/s with
FLOPs = 4 * Hq * D per visible (query, key) pair, timed by `triton.testing.do_bench` (median, L2
cleared). Peers: SDPA flash and cuDNN on the same keys, dense and contiguous (a bottom-right
causal mask for the chunk); our output is checked against flash's.

Writes `DIR/kernel_targets.json` (after every shape) and `.png`. Without CUDA it exits with code 2.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from collections.abc import Callable
from typing import Any

import attrs
import torch
from attn_bench.timing import rel_err as error_stats
from attn_bench.timing import rotation_count, time_calls
from common import (
    add_out_argument,
    gpu_ms,
    make_console,
    output_dir,
    prefill_case,
    pyplot,
    run_header,
    save_figure,
    sdpa_prefill,
    write_json,
)

from unified_attn.backends.triton import ops
from unified_attn.utils import cdiv

SCHEMA = "unified_attn.benchmarks.kernel_targets/v1"


@attrs.frozen
class Shape:
    batch: int
    ctx: int
    heads: int = 32
    kv_heads: int = 8
    head_size: int = 128
    page: int = 16
    window: int | None = None
    sinks: bool = False
    target: tuple[str, float] | None = None  # ("us", at most) or ("tb_s", at least)

    @property
    def visible(self) -> int:
        return min(self.ctx, self.window) if self.window else self.ctx

    def bytes_read(self) -> int:
        kv = 2 * self.batch * self.visible * self.kv_heads * self.head_size * 2
        return kv + 2 * self.batch * self.heads * self.head_size * 2


SHAPES = {
    "b1-4k": Shape(1, 4096, target=("us", 35.0)),
    "b1-32k": Shape(1, 32768, target=("tb_s", 2.2)),
    "b16-8k": Shape(16, 8192, target=("tb_s", 2.8)),
    "b32-8k": Shape(32, 8192, target=("tb_s", 2.8)),
    "b64-8k": Shape(64, 8192),
    "b64-8k-page64": Shape(64, 8192, page=64, target=("tb_s", 2.9)),
    "b64-32k": Shape(64, 32768, target=("tb_s", 3.0)),
    # a sliding-window layer at a long context: its 4k visible keys split like b1-4k's
    "b1-32k-window4k": Shape(1, 32768, window=4096),
    # the decode rows of benchmarks/model_step.py's Llama-3-8B step (128-token prompts)
    "b64-152": Shape(64, 152),
    "b256-152": Shape(256, 152),
    "gpt-oss": Shape(64, 8192, 64, 8, 64, window=128, sinks=True, target=("us", 40.0)),
    "gpt-oss-page64": Shape(64, 8192, 64, 8, 64, page=64, window=128, sinks=True),
}


class Case:
    """`rotations` caches of one shape, the queries, and the launch over each cache."""

    def __init__(self, shape: Shape, rotations: int) -> None:
        gen = torch.Generator(device="cuda").manual_seed(shape.batch * 7919 + shape.ctx)
        self.shape = s = shape
        pages = -(-s.ctx // s.page)
        first = (s.ctx - s.visible) // s.page  # pages before it are never read
        live = pages - first
        table = torch.zeros(s.batch, pages, dtype=torch.int32, device="cuda")
        ids = torch.randperm(s.batch * live, generator=gen, device="cuda").int() + 1
        table[:, first:] = ids.view(s.batch, live)
        self.table = table
        shape5 = (s.batch * live + 1, 2, s.page, s.kv_heads, s.head_size)
        self.caches = [
            torch.randn(shape5, generator=gen, device="cuda", dtype=torch.bfloat16)
            for _ in range(rotations)
        ]
        self.q = torch.randn(s.batch, s.heads, s.head_size, generator=gen, device="cuda")
        self.q = self.q.to(torch.bfloat16)
        self.qsl = torch.arange(s.batch + 1, dtype=torch.int32, device="cuda")
        self.seq_lens = torch.full((s.batch,), s.ctx, dtype=torch.int32, device="cuda")
        self.sinks = torch.randn(s.heads, generator=gen, device="cuda") if s.sinks else None
        self.scratch = ops.SplitScratch()

    def shipped_split(self) -> ops.SplitPlan | None:
        s = self.shape
        return ops.plan_split(max_query_len=1, max_seq_len=s.ctx, num_reqs=s.batch,
                              num_kv_heads=s.kv_heads, device=torch.device("cuda"))  # fmt: skip

    def calls(self, split: ops.SplitPlan | None) -> list[Callable[[], torch.Tensor]]:
        s = self.shape

        def call(cache: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            return ops.unified_attention(
                self.q, cache[:, 0], cache[:, 1], out, query_start_loc=self.qsl,
                seq_lens=self.seq_lens, block_table=self.table, num_seqs=s.batch,
                max_query_len=1, scale=s.head_size**-0.5, window=s.window, sinks=self.sinks,
                split=split, scratch=self.scratch,
            )  # fmt: skip

        return [functools.partial(call, c, torch.empty_like(self.q)) for c in self.caches]

    def dense(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V `[B, Hkv, visible, D]`, contiguous: the visible keys of every request."""
        s = self.shape
        pos = torch.arange(s.ctx - s.visible, s.ctx, device="cuda")
        blocks = self.table[:, pos // s.page].long()  # [B, visible]
        k = cache[blocks, 0, pos % s.page]  # [B, visible, Hkv, D]
        v = cache[blocks, 1, pos % s.page]
        return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()

    def oracle(self, cache: torch.Tensor, requests: int = 2) -> torch.Tensor:
        """float32 attention of the first `requests` queries over their visible keys (and the
        sinks)."""
        s = self.shape
        group = s.heads // s.kv_heads
        k, v = (x[:requests].float().repeat_interleave(group, dim=1) for x in self.dense(cache))
        q = self.q[:requests].float()
        scores = torch.einsum("bhd,bhkd->bhk", q, k) * s.head_size**-0.5
        if self.sinks is not None:
            sinks = self.sinks[None, :, None].expand(q.shape[0], -1, 1)
            scores = torch.cat([scores, sinks], dim=2)
        probs = scores.softmax(dim=-1)[..., : k.shape[2]]
        return torch.einsum("bhk,bhkd->bhd", probs, v)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|."""
    return error_stats(got, ref)["max_rel_err"]


def time_shape(case: Case, split: ops.SplitPlan | None) -> float:
    ms, _ = time_calls(case.calls(split), graph=True)
    return ms * 1e3  # µs


def sdpa_peers(case: Case, ours: torch.Tensor) -> dict[str, Any]:
    s = case.shape
    out: dict[str, Any] = {}
    dense = [case.dense(c) for c in case.caches]
    q4 = case.q[:, :, None]  # [B, Hq, 1, D]
    for name, backend in (("sdpa_flash", "FLASH_ATTENTION"), ("sdpa_cudnn", "CUDNN_ATTENTION")):
        sdpa_backend = getattr(torch.nn.attention.SDPBackend, backend)

        def call(k: torch.Tensor, v: torch.Tensor, b: Any = sdpa_backend) -> torch.Tensor:
            with torch.nn.attention.sdpa_kernel(b):
                return torch.nn.functional.scaled_dot_product_attention(
                    q4, k, v, scale=s.head_size**-0.5, enable_gqa=True
                )

        try:
            first = call(*dense[0])[:, :, 0]
            ms, _ = time_calls([functools.partial(call, k, v) for k, v in dense], graph=True)
            out[name] = {"us": ms * 1e3, "rel_err_vs_ours": rel_err(ours, first)}
        except Exception as error:  # a backend that refuses the shape
            out[name] = {"error": f"{type(error).__name__}: {str(error)[:160]}"}
    return out


SWEEP_CONFIGS = list(itertools.product((32, 64, 128), (4, 8), (2, 3, 4)))
SWEEP_SEGMENTS = (1, 2, 4, 8, 16, 32, 64)


def sweep(
    case: Case, configs: list[tuple[int, ...]], segments: tuple[int, ...]
) -> list[dict[str, Any]]:
    """Split counts x tiles (TILE, warps, stages[, max registers]), each timed
    like the shipped launch."""
    s = case.shape
    shipped_tile = ops.tile_config
    rows = []
    counts = [n for n in segments if s.ctx // n >= 64]
    for n, config in itertools.product(counts, configs):
        split = None if n == 1 else ops.SplitPlan(n, cdiv(cdiv(s.ctx, n), 64) * 64)
        cfg = ops.TileConfig(16, *config)
        ops.tile_config = lambda *_a, _c=cfg, **_k: _c
        try:
            us = time_shape(case, split)
        except Exception as error:  # out of resources etc.
            us = float("nan")
            print(f"    {n} segments {cfg}: {type(error).__name__}", flush=True)
        finally:
            ops.tile_config = shipped_tile
        rows.append({"segments": n, "tile": cfg.tile, "warps": cfg.num_warps,
                     "stages": cfg.num_stages, "max_registers": cfg.max_registers, "us": us,
                     "tb_s": s.bytes_read() / us / 1e6})  # fmt: skip
    good = [r for r in rows if r["us"] == r["us"]]
    for r in sorted(good, key=lambda r: r["us"])[:3]:
        print(f"    best: {r}", flush=True)
    return rows


def measure(name: str, shape: Shape, copy_tb_s: float, args: argparse.Namespace) -> dict[str, Any]:
    per_cache = 2 * shape.batch * shape.visible * shape.kv_heads * shape.head_size * 2
    # At least two caches, so every shape is timed as a captured graph like the engine's decode:
    # a single cache would fall back to do_bench, whose L2 flush leaves up to 50 MB of dirty
    # lines to write back during the timed call (6 µs of 203 at batch 16 / 8k on the H100).
    case = Case(shape, max(2, rotation_count(per_cache)))
    split = case.shipped_split()
    ours = case.calls(split)[0]().clone()
    us = time_shape(case, split)
    tb_s = shape.bytes_read() / us / 1e6
    rec: dict[str, Any] = {
        "name": name, "shape": attrs.asdict(shape), "rotations": len(case.caches),
        "split": attrs.asdict(split) if split else None, "us": us, "tb_s": tb_s,
        "pct_of_copy": 100 * tb_s / copy_tb_s,
        "rel_err_vs_fp32": rel_err(ours[:2], case.oracle(case.caches[0])),
    }  # fmt: skip
    if shape.target:
        unit, bound = shape.target
        rec["target"] = {"unit": unit, "bound": bound,
                         "met": us <= bound if unit == "us" else tb_s >= bound}  # fmt: skip
    if not shape.sinks:
        rec["peers"] = sdpa_peers(case, ours)
    line = f"{name}: {us:.1f} µs, {tb_s:.2f} TB/s ({rec['pct_of_copy']:.0f}% of copy)"
    for peer, r in rec.get("peers", {}).items():
        line += f", {peer} {r['us']:.1f} µs" if "us" in r else f", {peer} refused"
    print(line + f", split {rec['split']}, err {rec['rel_err_vs_fp32']:.1e}", flush=True)
    if args.sweep:
        rec["sweep"] = sweep(case, args.sweep_configs, args.sweep_segments)
    del case
    torch.cuda.empty_cache()
    return rec


def copy_bandwidth() -> float:
    n = 1 << 30  # 2 GiB of bf16
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = gpu_ms(functools.partial(dst.copy_, src))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 2 / ms / 1e9


# ---- prefill ---------------------------------------------------------------------------------

PREFILL_LENGTHS = (2048, 4096, 8192, 16384, 32768)
PREFILL_PAGES = (16, 64)
PREFILL_TARGETS = {64: 1.2, 16: 1.0}  # x SDPA flash, per page size
CHUNK = (512, 32768)  # queries, cached keys
CHUNK_TARGET_TFLOPS = 300.0


def measure_prefill(length: int, context: int) -> list[dict[str, Any]]:
    rows = []
    peers: dict[str, Any] | None = None
    for page in PREFILL_PAGES:
        case = prefill_case(length, context=context, page=page)
        if peers is None:  # the same keys at every page size: measure the peers once
            peers = sdpa_prefill(case, context)
        ours = case["launch"]().clone()
        tflops = case["flops"] / gpu_ms(case["launch"]) / 1e9
        rec: dict[str, Any] = {"len": length, "context": context, "page": page,
                               "tflops": tflops}  # fmt: skip
        for name, peer in peers.items():
            if "tflops" in peer:
                rec[name] = {"tflops": peer["tflops"], "ours_over_peer": tflops / peer["tflops"],
                             "rel_err_vs_ours": rel_err(ours, peer["out"])}  # fmt: skip
            else:
                rec[name] = {"error": peer["error"]}
        flash = rec["sdpa_flash"].get("ours_over_peer")
        if context:
            rec["target"] = {"unit": "tflops", "bound": CHUNK_TARGET_TFLOPS,
                             "met": tflops >= CHUNK_TARGET_TFLOPS}  # fmt: skip
        elif flash is not None:
            bound = PREFILL_TARGETS[page]
            rec["target"] = {"unit": "x_flash", "bound": bound, "met": flash >= bound}
        cudnn = rec["sdpa_cudnn"].get("ours_over_peer")
        print(f"prefill L={length} context={context} page={page}: {tflops:.0f} TFLOP/s, "
              f"{flash or float('nan'):.2f}x flash, {cudnn or float('nan'):.2f}x cuDNN, "
              f"err {rec['sdpa_flash'].get('rel_err_vs_ours', float('nan')):.1e}",
              flush=True)  # fmt: skip
        rows.append(rec)
        del case
    torch.cuda.empty_cache()
    return rows


# ---- report ----------------------------------------------------------------------------------


def plot(result: dict[str, Any], path: Any) -> None:
    """Decode TB/s per shape (ours and SDPA cuDNN on dense K/V where it runs) and prefill
    TFLOP/s per length (ours per page, SDPA flash and cuDNN)."""
    plt = pyplot(make_console(100))
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(16, 5))
    records = result.get("decode", [])
    xs = list(range(len(records)))
    peer_tb_s = []
    for rec in records:
        peer_us = rec.get("peers", {}).get("sdpa_cudnn", {}).get("us")
        peer_tb_s.append(Shape(**rec["shape"]).bytes_read() / peer_us / 1e6 if peer_us else 0.0)
    ax1.bar([x - 0.2 for x in xs], [r["tb_s"] for r in records], 0.4, label="ours (paged)")
    ax1.bar([x + 0.2 for x in xs], peer_tb_s, 0.4, label="SDPA cuDNN (dense)")
    ax1.set_xticks(xs, [r["name"] for r in records], rotation=20)
    ax1.set_ylabel("TB/s of bytes read")
    ax1.legend()
    ax1.set_title("Decode, bf16, CUDA-graph timing")
    rows = [r for r in result.get("prefill", []) if not r["context"]]
    lengths = sorted({r["len"] for r in rows})
    for page in PREFILL_PAGES:
        ys = [next((r["tflops"] for r in rows if r["len"] == n and r["page"] == page), None)
              for n in lengths]  # fmt: skip
        ax2.plot(lengths, ys, marker="o", label=f"ours, page {page}")
    for peer in ("sdpa_flash", "sdpa_cudnn"):
        ys = [next((r[peer].get("tflops") for r in rows if r["len"] == n), None) for n in lengths]
        ax2.plot(lengths, ys, marker="x", linestyle="--", label=peer.replace("_", " "))
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("prompt tokens")
    ax2.set_ylabel("TFLOP/s")
    ax2.legend()
    ax2.set_title("Causal prefill, 32q/8kv/d128, bf16")
    save_figure(fig, path, 120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_out_argument(ap)
    ap.add_argument("--sections", default="decode,prefill")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="decode shapes, comma-separated")
    ap.add_argument("--sweep", action="store_true", help="also time split counts and tiles")
    ap.add_argument("--sweep-configs", default="", help="TILE/WARPS/STAGES[/MAXNREG],...")
    ap.add_argument("--sweep-segments", default="", help="split counts, comma-separated")
    args = ap.parse_args(argv)
    raw = (args.sweep_configs, args.sweep_segments)
    try:
        args.sweep_configs = [
            tuple(int(x) for x in c.split("/")) for c in args.sweep_configs.split(",") if c
        ] or SWEEP_CONFIGS
        args.sweep_segments = (
            tuple(int(x) for x in args.sweep_segments.split(",") if x) or SWEEP_SEGMENTS
        )
        if any(len(c) not in (3, 4) for c in args.sweep_configs):
            raise ValueError
    except ValueError:
        print(f"--sweep-configs takes TILE/WARPS/STAGES[/MAXNREG],... and "
              f"--sweep-segments integers, got {raw[0]!r} and {raw[1]!r}",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2) from None
    unknown = [n for n in args.shapes.split(",") if n not in SHAPES]
    if unknown:
        print(f"unknown shapes {unknown}; choose from {list(SHAPES)}", file=sys.stderr)
        raise SystemExit(2)
    sections = args.sections.split(",")
    if not sections or set(sections) - {"decode", "prefill"}:
        print(f"--sections takes decode and/or prefill, got {args.sections!r}", file=sys.stderr)
        raise SystemExit(2)
    if not torch.cuda.is_available():
        print("benchmarks/kernel_targets.py needs a CUDA GPU", file=sys.stderr)
        raise SystemExit(2)
    result = run_header(SCHEMA, "kernel_targets.py", False, argv)
    result["machine"]["gpu"] = torch.cuda.get_device_name()
    result["copy_tb_s"] = copy_tb_s = copy_bandwidth()
    print(f"copy ceiling {copy_tb_s:.2f} TB/s", flush=True)
    out = output_dir(args)
    if "decode" in sections:
        records = result["decode"] = []
        for name in args.shapes.split(","):
            records.append(measure(name, SHAPES[name], copy_tb_s, args))
            write_json(out / "kernel_targets.json", result)
    if "prefill" in sections:
        rows = result["prefill"] = []
        for length, context in [(n, 0) for n in PREFILL_LENGTHS] + [CHUNK]:
            rows += measure_prefill(length, context)
            write_json(out / "kernel_targets.json", result)
    plot(result, out / "kernel_targets.png")


if __name__ == "__main__":
    main()
