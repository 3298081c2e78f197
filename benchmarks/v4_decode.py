"""DeepSeek-V4 decode attention on the Triton kernel: a CSA layer's two partial attentions (the
sliding window of latents and the top-k compressed entries), in one run with the copy ceiling
and the reference (torch gather + einsum) peer.

    python benchmarks/v4_decode.py [--out DIR] [--batch 64] [--context 65536] [--quick]

Shape (issue 10): 64 query heads of 512 (shared-KV MQA), window 128, compression rate 4, top-k
512, batch 64, 64k context, bf16, page 64 for the latents (16 entries per compressed page).
Each request's window is its last 128 positions; its top-k names 512 random complete entries.
Bytes touched per token: (128 + 512) rows of 512 bf16, plus its queries and outputs. Target: the
two launches within 1.5x of the time to move those bytes at the measured device-to-device copy
bandwidth (bytes read + written of a 2 GiB copy). Writes `DIR/v4_decode.json`.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import attrs
import torch
from common import add_out_argument, command_line, output_dir, utc_timestamp, write_json

from unified_attn.backends.deepseek_v4_steps import partial_attention
from unified_attn.backends.triton.v4_ops import gathered_attention
from unified_attn.harness.bench import machine_info

TARGET = 1.5


def copy_tb_s() -> float:
    from common import gpu_ms

    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / gpu_ms(functools.partial(dst.copy_, src)) / 1e9


def make_case(args: argparse.Namespace) -> dict[str, Any]:
    """The caches, lists and queries of one decode step (random data)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, ctx, d, page = args.batch, args.context, args.head_size, args.page
    entries = ctx // args.rate
    pages, entry_pages = ctx // page, entries // (page // args.rate)
    latents = torch.randn(b * pages + 1, page, d, device="cuda", generator=gen).bfloat16()
    compressed = torch.randn(b * entry_pages + 1, page // args.rate, d, device="cuda",
                             generator=gen).bfloat16()  # fmt: skip
    table = torch.randperm(b * pages, device="cuda", generator=gen).view(b, pages) + 1
    entry_table = torch.randperm(b * entry_pages, device="cuda", generator=gen).view(b, -1) + 1
    window = torch.arange(ctx - args.window, ctx, device="cuda").expand(b, -1)  # positions
    rows = torch.arange(b, device="cuda")[:, None]
    picks = torch.rand(b, entries, device="cuda", generator=gen).topk(args.topk, dim=1).indices
    per = page // args.rate
    return {
        "q": torch.randn(b, args.heads, d, device="cuda", generator=gen).bfloat16(),
        "swa": (latents, table[rows, window // page], window % page),
        "compressed": (compressed, entry_table[rows, picks // per], picks % per),
    }


def launches(case: dict[str, Any], scale: float) -> dict[str, Any]:
    q = case["q"]
    out = {k: torch.empty_like(q) for k in ("swa", "compressed")}
    lse = {k: torch.empty(q.shape[:2], device="cuda") for k in out}

    def triton(name: str) -> None:
        cache, blocks, offsets = case[name]
        valid = torch.ones(blocks.shape, dtype=torch.bool, device="cuda")
        gathered_attention(q, cache, blocks, offsets, valid, scale, out[name], lse[name])

    def reference(name: str) -> None:
        cache, blocks, offsets = case[name]
        valid = torch.ones(blocks.shape, dtype=torch.bool, device="cuda")
        partial_attention(q, cache[blocks, offsets], valid, scale, out[name], lse[name])

    return {"triton": triton, "reference": reference, "out": out, "lse": lse}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in [("batch", 64), ("context", 65536), ("heads", 64), ("head-size", 512),
                          ("window", 128), ("rate", 4), ("topk", 512), ("page", 64)]:  # fmt: skip
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--quick", action="store_true", help="batch 4, 8k context")
    parser.add_argument("--sweep", action="store_true", help="also time every GatherConfig")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.context = 4, 8192
    from common import gpu_ms

    case = make_case(args)
    run = launches(case, args.head_size**-0.5)
    result: dict[str, Any] = {"benchmark": "v4_decode", "command": command_line(__file__, argv),
                              "timestamp": utc_timestamp(), "machine": machine_info(),
                              "shape": vars(args), "copy_tb_s": copy_tb_s()}  # fmt: skip
    q_bytes = case["q"].numel() * 2 * 2  # read q, write the output
    for name in ("swa", "compressed"):
        blocks = case[name][1]
        touched = blocks.numel() * args.head_size * 2 + q_bytes
        row: dict[str, Any] = {"bytes": touched}
        for impl in ("triton", "reference"):
            run[impl](name)
            got = run["out"][name].float().clone()
            row[f"{impl}_ms"] = gpu_ms(functools.partial(run[impl], name))
            row[f"{impl}_out"] = got
        row["max_diff"] = (row.pop("triton_out") - row.pop("reference_out")).abs().max().item()
        result[name] = row
    total_bytes = result["swa"]["bytes"] + result["compressed"]["bytes"]
    ideal_ms = total_bytes / result["copy_tb_s"] / 1e9
    triton_ms = result["swa"]["triton_ms"] + result["compressed"]["triton_ms"]
    reference_ms = result["swa"]["reference_ms"] + result["compressed"]["reference_ms"]
    result["total"] = {"bytes": total_bytes, "ideal_ms": ideal_ms, "triton_ms": triton_ms,
                       "reference_ms": reference_ms, "over_ideal": triton_ms / ideal_ms,
                       "tb_s": total_bytes / triton_ms / 1e9, "target": TARGET,
                       "met": triton_ms / ideal_ms <= TARGET,
                       "speedup_over_reference": reference_ms / triton_ms}  # fmt: skip
    print(f"[v4_decode] copy {result['copy_tb_s']:.2f} TB/s", flush=True)
    for name in ("swa", "compressed"):
        r = result[name]
        print(f"[v4_decode] {name}: triton {r['triton_ms'] * 1e3:.1f} us, reference "
              f"{r['reference_ms'] * 1e3:.1f} us, {r['bytes'] / 1e6:.1f} MB, max diff "
              f"{r['max_diff']:.3g}", flush=True)  # fmt: skip
    t = result["total"]
    print(f"[v4_decode] total {t['triton_ms'] * 1e3:.1f} us = {t['over_ideal']:.2f}x the copy "
          f"time of {t['bytes'] / 1e6:.1f} MB ({t['tb_s']:.2f} TB/s), target <= {TARGET}x: "
          f"{'met' if t['met'] else 'missed'}; {t['speedup_over_reference']:.1f}x the reference",
          flush=True)  # fmt: skip
    if args.sweep:
        result["sweep"] = sweep(case, args.head_size**-0.5)
    write_json(output_dir(args) / "v4_decode.json", result)
    return result


def sweep(case: dict[str, Any], scale: float) -> list[dict[str, Any]]:
    """Every kernel configuration on both lists: microseconds per launch."""
    import itertools

    from common import gpu_ms

    from unified_attn.backends.triton.v4_ops import GatherConfig

    q, rows = case["q"], []
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], device="cuda")
    for heads, tile, warps, stages in itertools.product((16, 32, 64), (16, 32, 64), (4, 8),
                                                        (1, 2, 3)):  # fmt: skip
        cfg = GatherConfig(heads, tile, warps, stages)
        row: dict[str, Any] = attrs.asdict(cfg)
        for name in ("swa", "compressed"):
            cache, blocks, offsets = case[name]
            valid = torch.ones(blocks.shape, dtype=torch.bool, device="cuda")
            call = functools.partial(gathered_attention, q, cache, blocks, offsets, valid, scale,
                                     out, lse, cfg)  # fmt: skip
            try:
                row[f"{name}_us"] = gpu_ms(call) * 1e3
            except Exception as error:  # out of resources
                row[f"{name}_us"] = float("nan")
                row["error"] = type(error).__name__
        rows.append(row)
        print(f"[v4_decode] {cfg}: swa {row['swa_us']:.1f} us, compressed "
              f"{row['compressed_us']:.1f} us", flush=True)  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
