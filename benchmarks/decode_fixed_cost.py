"""Paged decode attention's fixed cost: our Triton launcher (`backends/triton/ops.py`'s
`unified_attention`) against vLLM 0.33's Triton `unified_attention` as a same-run peer.

    python benchmarks/vllm_peers.py /path/to/vllm-0.33.0-*.whl   # once: benchmarks/peers/vllm_attn
    python benchmarks/decode_fixed_cost.py [--out DIR] [--quick] [--batches 1,4] [--contexts 4096]
                                           [--profile-host] [--baseline OLD.json] [--no-peer]
    TRITON_INTERPRET=1 python benchmarks/decode_fixed_cost.py --quick --device cpu   # smoke run

Decode batches (one query token per request, every request `ctx` tokens; 32 query / 8 KV
heads, head 128, page 16, bf16; random data on randomly permuted pages) for batch 1, 4, 16,
64, 256 x context 1k, 4k, 32k (shapes with more than `--max-kv-gib` of KV skipped). Ours is
called as `TritonAttentionBackend` calls it for decode: `plan_split` and the `SplitScratch`
sized by `prep_forward` (once per step, outside the timed call), then the launcher. vLLM's as
its `TritonAttentionImpl` calls it (`decode_peer_calls.py`). Per shape and side:

- eager: wall us per call of N back-to-back calls between two `torch.cuda.synchronize()`,
  host launch work included (what a caller sees), and the host's submit time alone;
- graph: the calls captured in one CUDA graph, replayed, timed by CUDA events (device us);
- TB/s: K + V + Q + output bytes / device time, and its fraction of the device-to-device
  copy bandwidth measured in the same run.

Calls rotate over copies of the cache (`attn_bench`'s rotation: >= 256 MiB touched below 200
MB of KV) so L2 does not serve the keys.
`vllm_over_ours_*` > 1: ours is faster. Outputs are compared (max |diff|) with each other and
with a float32 SDPA reference on the gathered K/V (GQA expanded) for up to 8 requests.
`--profile-host` splits our host time at batch 1 / 4k (`decode_host_profile.py`). Writes
`DIR/decode_fixed_cost.json` (after every shape) and `.png`. Without the peer folder, ours only.
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
from attn_bench.timing import rel_err, rotation_count
from common import (
    add_out_argument,
    capture_graph,
    gpu_ms,
    make_console,
    output_dir,
    run_header,
    write_json,
)
from decode_peer_calls import load_vllm_attn, vllm_calls

SCHEMA = "unified_attn.benchmarks.decode_fixed_cost/v1"
TARGET = {"batch": 1, "ctx": 4096, "eager_us": 75.0}  # the issue: ours <= 75 us per call
FULL: dict[str, Any] = {"batches": [1, 4, 16, 64, 256], "contexts": [1024, 4096, 32768],
                        "heads": 32, "kv_heads": 8, "head_size": 128, "page": 16,
                        "dtype": "bfloat16", "eager_s": 0.25, "repeats": 5, "min_iters": 20,
                        "max_iters": 2000, "graph_s": 0.25, "profile_iters": 2000}  # fmt: skip
QUICK_CUDA: dict[str, Any] = {**FULL, "batches": [1, 64], "contexts": [4096], "repeats": 3}
QUICK_CPU: dict[str, Any] = {**FULL, "batches": [1, 3], "contexts": [40, 1100], "heads": 4,
                             "kv_heads": 2, "head_size": 32, "dtype": "float16", "repeats": 1,
                             "min_iters": 1, "max_iters": 2, "profile_iters": 3}  # fmt: skip
REF_REQUESTS = 8


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_out_argument(ap)
    ap.add_argument("--quick", action="store_true", help="a few small shapes, a smoke run")
    ap.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: Triton's interpreter, --quick only (no graphs, no peer)",
    )
    ap.add_argument("--batches", type=int_list, help="batch sizes, comma-separated")
    ap.add_argument("--contexts", type=int_list, help="context lengths, comma-separated")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), help="q and cache")
    ap.add_argument("--max-kv-gib", type=float, default=40.0, help="skip larger shapes")
    ap.add_argument("--no-peer", action="store_true", help="ours only")
    ap.add_argument(
        "--vllm-kv-layout",
        choices=("vllm", "ours"),
        default="vllm",
        help="vLLM reads its own [blocks, page, Hkv, 2D] copy, or our cache",
    )
    ap.add_argument(
        "--profile-host",
        action="store_true",
        help="also split our host time per call at batch 1 / 4k",
    )
    ap.add_argument("--baseline", help="an earlier run's JSON: ours now / ours then per shape")
    args = ap.parse_args(argv)  # fmt: skip
    if args.device == "cpu" and not args.quick:
        ap.error("--device cpu runs the interpreter: only with --quick")
    base = QUICK_CPU if args.device == "cpu" else QUICK_CUDA if args.quick else FULL
    args.params = dict(base)
    for key in ("batches", "contexts", "dtype"):
        if getattr(args, key):
            args.params[key] = getattr(args, key)
    args.argv = argv
    return args


def require_device(args: argparse.Namespace) -> torch.device:
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
        if os.environ["TRITON_INTERPRET"] != "1":
            raise SystemExit("--device cpu needs TRITON_INTERPRET=1")
        return torch.device("cpu")
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return torch.device("cuda")
    print("benchmarks/decode_fixed_cost.py needs a CUDA GPU without TRITON_INTERPRET=1; use "
          "--quick --device cpu for a smoke run.", file=sys.stderr, flush=True)  # fmt: skip
    raise SystemExit(2)


# ---- timing ----------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def eager_timing(calls: Sequence[Callable[[], Any]], p: dict, device: torch.device) -> dict:
    """Wall us per call of N back-to-back calls (cycling over `calls`) between two
    synchronizes, median of `repeats`; `host_submit_us`: the loop alone, before the sync."""
    for call in calls:
        call()  # compiled and warm
    sync(device)
    start = time.perf_counter()
    calls[0]()
    sync(device)
    one = time.perf_counter() - start
    iters = max(p["min_iters"], min(p["max_iters"], int(p["eager_s"] / max(one, 1e-7))))
    walls, hosts = [], []
    for _ in range(p["repeats"]):
        sync(device)
        t0 = time.perf_counter()
        for i in range(iters):
            calls[i % len(calls)]()
        t1 = time.perf_counter()
        sync(device)
        t2 = time.perf_counter()
        walls.append((t2 - t0) / iters * 1e6)
        hosts.append((t1 - t0) / iters * 1e6)
    return {"eager_us": statistics.median(walls), "eager_us_runs": walls,
            "host_submit_us": statistics.median(hosts), "eager_iters": iters}  # fmt: skip


def graph_timing(calls: Sequence[Callable[[], Any]], p: dict) -> dict:
    """Device us per call: all `calls` captured in one CUDA graph, replayed between two CUDA
    events (median of `repeats` timings of `replays` replays)."""
    graph = capture_graph(calls)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def replay_ms(replays: int) -> float:
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    replays = max(3, min(2000, int(p["graph_s"] * 1e3 / max(replay_ms(1), 1e-4))))
    runs = [replay_ms(replays) * 1e3 / (replays * len(calls)) for _ in range(p["repeats"])]
    return {"graph_us": statistics.median(runs), "graph_us_runs": runs, "graph_replays": replays}


def copy_tb_s() -> float:
    """Device-to-device copy bandwidth, bytes read + written (1 GiB buffers)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (gpu_ms(lambda: dst.copy_(src)) * 1e-3) / 1e12


# ---- one shape -------------------------------------------------------------------------------


class Case:
    """`batch` requests of `ctx` tokens on a randomly permuted paged cache (block 0 unused),
    in `rotations` copies; the queries, block table and metadata of the decode step."""

    def __init__(self, p: dict, batch: int, ctx: int, device: torch.device, rotations: int):
        self.p, self.batch, self.ctx, self.device = p, batch, ctx, device
        self.dtype = getattr(torch, p["dtype"])
        hq, hkv, d, page = p["heads"], p["kv_heads"], p["head_size"], p["page"]
        pages = -(-ctx // page)
        shape = (batch * pages + 1, 2, page, hkv, d)
        self.caches = [torch.empty(shape, dtype=self.dtype, device=device).normal_()
                       for _ in range(rotations)]  # fmt: skip
        perm = torch.randperm(batch * pages, device=device) + 1
        self.table = perm.view(batch, pages).to(torch.int32)
        self.q = torch.empty(batch, hq, d, dtype=self.dtype, device=device).normal_()
        self.qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        self.scale = d**-0.5
        item = self.dtype.itemsize
        self.kv_bytes = batch * ctx * 2 * hkv * d * item
        self.bytes_read = self.kv_bytes + 2 * self.q.numel() * item


def kv_bytes_of(p: dict, batch: int, ctx: int) -> int:
    return batch * ctx * 2 * p["kv_heads"] * p["head_size"] * getattr(torch, p["dtype"]).itemsize


def ours_calls(case: Case) -> tuple[list[Callable[[], torch.Tensor]], torch.Tensor, Any]:
    """Our launcher over each cache copy, as the Triton backend runs a decode step: the split
    planned and the scratch sized once (`plan_split`, `prep_forward`), then `forward`'s call."""
    from unified_attn.backends.triton import ops

    p = case.p
    split = ops.plan_split(max_query_len=1, max_seq_len=case.ctx, num_reqs=case.batch,
                           num_kv_heads=p["kv_heads"], device=case.device)  # fmt: skip
    scratch = ops.SplitScratch()
    if split is not None:
        head_pad = max(16, 1 << (p["head_size"] - 1).bit_length())
        scratch.ensure(case.batch * p["heads"], split.num_segments, head_pad, case.device)
    out = torch.empty_like(case.q)

    def make(cache: torch.Tensor) -> Callable[[], torch.Tensor]:
        k_cache, v_cache = cache[:, 0], cache[:, 1]
        return lambda: ops.unified_attention(
            case.q, k_cache, v_cache, out, query_start_loc=case.qsl, seq_lens=case.seq_lens,
            block_table=case.table, num_seqs=case.batch, max_query_len=1, scale=case.scale,
            causal=True, window=None, chunk=None, soft_cap=None, sinks=None, alibi_slopes=None,
            sink_tokens=0, split=split, scratch=scratch, batch_invariant=False, kv_scales=None,
        )  # fmt: skip

    return [make(c) for c in case.caches], out, split


def reference(case: Case, requests: list[int]) -> torch.Tensor:
    """float32 SDPA over each request's gathered keys and values, KV heads expanded (GQA)."""
    p = case.p
    qpk, page = p["heads"] // p["kv_heads"], p["page"]
    pos = torch.arange(case.ctx, device=case.device)
    outs = []
    for i in requests:
        blocks, offsets = case.table[i, pos // page].long(), pos % page
        k, v = (case.caches[0][blocks, j, offsets].float().transpose(0, 1) for j in (0, 1))
        k, v = (x.repeat_interleave(qpk, dim=0)[None] for x in (k, v))
        q = case.q[i].float()[None, :, None]  # [1, Hq, 1, D]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=case.scale)
        outs.append(out[0, :, 0])
    return torch.stack(outs)


def side(calls: Sequence[Callable], case: Case, p: dict, copy_bw: float | None) -> dict:
    rec = eager_timing(calls, p, case.device)
    rec["eager_tb_s"] = case.bytes_read / rec["eager_us"] / 1e6
    if case.device.type == "cuda":
        rec.update(graph_timing(calls, p))
        rec["graph_tb_s"] = case.bytes_read / rec["graph_us"] / 1e6
        rec["graph_copy_fraction"] = rec["graph_tb_s"] / copy_bw if copy_bw else None
    return rec


def bench_shape(p: dict, batch: int, ctx: int, device: torch.device, op: Any, layout: str,
                copy_bw: float | None) -> dict:  # fmt: skip
    rotations = rotation_count(kv_bytes_of(p, batch, ctx)) if device.type == "cuda" else 1
    case = Case(p, batch, ctx, device, rotations)
    row: dict[str, Any] = {"batch": batch, "ctx": ctx, "kv_bytes": case.kv_bytes,
                           "bytes_read": case.bytes_read,
                           "rotations": len(case.caches)}  # fmt: skip
    calls, out, split = ours_calls(case)
    row["split"] = None if split is None else {"num_segments": split.num_segments,
                                               "segment": split.segment}  # fmt: skip
    row["ours"] = side(calls, case, p, copy_bw)
    n = min(batch, REF_REQUESTS)  # spread over the batch, first and last included
    requests = sorted({round(i * (batch - 1) / max(1, n - 1)) for i in range(n)})
    calls[0]()
    ours_out = out.clone()
    ref = reference(case, requests)
    row["ref_requests"] = requests
    row["diff"] = {"ours_vs_ref": rel_err(ours_out[requests], ref)}
    row["finite"] = {"ours": bool(torch.isfinite(ours_out).all())}
    if op is not None:
        try:  # vLLM's side fails alone (a Triton it does not compile with, say)
            vcalls, vout, row["vllm_info"] = vllm_calls(case, op, layout)
            row["vllm"] = side(vcalls, case, p, copy_bw)
            vcalls[0]()
        except Exception as error:
            row["vllm_error"] = f"{type(error).__name__}: {error}"[:800]
            return row
        row["diff"]["vllm_vs_ref"] = rel_err(vout[requests], ref)
        row["diff"]["ours_vs_vllm"] = rel_err(ours_out, vout)
        row["finite"]["vllm"] = bool(torch.isfinite(vout).all())
        for key in ("eager_us", "graph_us"):
            if key in row["ours"]:
                row[f"vllm_over_ours_{key[:-3]}"] = row["vllm"][key] / row["ours"][key]
    return row


# ---- run -------------------------------------------------------------------------------------


def shapes_of(p: dict, max_kv_gib: float) -> tuple[list[tuple[int, int]], list[dict]]:
    shapes, skipped = [], []
    for batch in p["batches"]:
        for ctx in p["contexts"]:
            if kv_bytes_of(p, batch, ctx) > max_kv_gib * (1 << 30):
                skipped.append({"batch": batch, "ctx": ctx, "why": f"KV over {max_kv_gib} GiB"})
            else:
                shapes.append((batch, ctx))
    return sorted(shapes, key=lambda s: s[0] * s[1]), skipped


def host_profile(p: dict, args: argparse.Namespace, device: torch.device, op: Any) -> dict:
    """`--profile-host`: our host time split at batch 1 / 4k (`--quick`: the longest context),
    with the eager wall time per call of the same shape beside it."""
    from decode_host_profile import profile_host

    ctx = max(p["contexts"]) if args.quick else TARGET["ctx"]
    case = Case(p, TARGET["batch"], ctx, device, 1)
    vllm = None
    if op is not None:
        try:
            vllm = vllm_calls(case, op, args.vllm_kv_layout)[0][0]
        except Exception as error:  # ours is profiled all the same
            print(f"vLLM's call not profiled: {type(error).__name__}: {error}"[:300], flush=True)
    prof = profile_host(case, p["profile_iters"], vllm)
    prof["pieces"]["eager_wall"] = {"median_us": eager_timing(ours_calls(case)[0], p,
                                                              device)["eager_us"]}  # fmt: skip
    return prof


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = require_device(args)
    from decode_report import baseline_check, plot, print_table, verdict

    console = make_console(160)
    p = args.params
    results: dict[str, Any] = run_header(SCHEMA, "decode_fixed_cost.py", args.quick, args.argv)
    results.update(device=str(device), params=p, shapes=[], errors=[])
    op = None
    if device.type != "cuda":
        results["peer_note"] = "no peer on the CPU (interpreter smoke run)"
    elif args.no_peer:
        results["peer_note"] = "--no-peer"
    elif (op := load_vllm_attn()) is None:
        results["peer_note"] = "no benchmarks/peers/vllm_attn: run vllm_peers.py first"
        console.print(f"[yellow]{results['peer_note']}; ours only[/]")
    results["vllm_peer"] = op is not None
    copy_bw = copy_tb_s() if device.type == "cuda" else None
    results["copy_tb_s"] = copy_bw
    shapes, results["skipped"] = shapes_of(p, args.max_kv_gib)
    torch.manual_seed(1234)
    path = output_dir(args) / "decode_fixed_cost.json"
    for batch, ctx in shapes:
        try:
            row = bench_shape(p, batch, ctx, device, op, args.vllm_kv_layout, copy_bw)
            results["shapes"].append(row)
            print(f"[decode_fixed_cost] B {batch} ctx {ctx}: ours {row['ours']['eager_us']:.1f} "
                  f"us eager, vLLM/ours {row.get('vllm_over_ours_eager', float('nan')):.2f}",
                  flush=True)  # fmt: skip
        except Exception as error:  # record and go on: one shape's failure keeps the others
            results["errors"].append(f"B {batch} ctx {ctx}: {type(error).__name__}: {error}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        results["verdict"] = verdict(results["shapes"], device.type == "cuda", TARGET)
        write_json(path, results)
    if args.baseline:
        results["baseline"] = baseline_check(results["shapes"], args.baseline)
    if args.profile_host:
        results["host_profile"] = host_profile(p, args, device, op)
        write_json(path, results)
    results["verdict"] = verdict(results["shapes"], device.type == "cuda", TARGET)
    write_json(path, results)
    print_table(console, results)
    png = plot(results, path.with_suffix(".png"), console)
    console.print(f"wrote {path}" + (f" and {png}" if png else ""))
    return results


if __name__ == "__main__":
    main()
