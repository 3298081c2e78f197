"""Gated delta rule kernels (`backends/triton/gated_delta_ops.py`, Qwen3-Next's linear attention)
at Qwen3-Next-80B-A3B's shapes (Hk=16, Hv=32, Dk=Dv=128, bfloat16 inputs, float32 states).

    python benchmarks/gated_delta_kernels.py [--out DIR] [--quick]

- decode (`gated_delta_update`, q/k normalised in the kernel), batch 1..256: read == write
  slot, each launch replayed from a CUDA graph that cycles over disjoint blocks (as
  `ssm_kernels.py`). Reported: us per launch, state bytes read + written / time as a fraction
  of the device-to-device copy bandwidth measured in this run (target >= 0.7), a tile sweep.
- prefill (`gated_delta_chunked_varlen`, token by token), one request and four:
  `triton.testing.do_bench` medians and tokens/s; the torch chunked form
  (`gated_delta_math.gated_delta_chunked`, request by request) beside it.

No peers yet (vLLM's fla kernels are not copied by `vllm_peers.py`). Writes
`DIR/gated_delta_kernels.json`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch
from common import add_out_argument, gpu_ms, make_console, output_dir, run_header, table, write_json
from ssm_kernels import copy_bandwidth, graph_us, rotations

SCHEMA = "unified_attn.benchmarks.gated_delta_kernels/v1"
HK, HV, DK, DV = 16, 32, 128, 128
DECODE_BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
PREFILL = [[2048], [8192], [512] * 4, [2048] * 4]
TILE_SWEEP = [(bv, w) for bv in (8, 16, 32, 64) for w in (2, 4, 8)]
DT = torch.bfloat16


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_out_argument(ap)
    ap.add_argument("--quick", action="store_true", help="a few shapes, for a smoke run")
    args = ap.parse_args(argv)
    args.argv = argv
    return args


def rule_inputs(rows: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device="cuda")

    return {"q": randn(rows, HK, DK).to(DT), "k": randn(rows, HK, DK).to(DT),
            "v": randn(rows, HV, DV).to(DT), "g": -torch.rand(rows, HV, device="cuda") * 0.5,
            "beta": torch.rand(rows, HV, device="cuda")}  # fmt: skip


def bench_decode(batch: int, copy_bw: float, sweep: bool) -> dict[str, Any]:
    from unified_attn.backends.triton import gated_delta_ops as ops

    state_bytes = 2 * batch * HV * DK * DV * 4
    turns = rotations(state_bytes)
    inp = rule_inputs(batch, seed=batch)
    pool = torch.randn(batch * turns, HV, DK, DV, device="cuda") * 0.1
    slots = [torch.arange(i * batch, (i + 1) * batch, dtype=torch.int32, device="cuda")
             for i in range(turns)]  # fmt: skip
    o = torch.empty_like(inp["v"])

    def at(block_v: int, warps: int) -> float:
        launches = [
            lambda s=s: ops.launch_update(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                          pool, s, s, o, DK**-0.5, True, block_v, warps)
            for s in slots
        ]  # fmt: skip
        return graph_us(launches)

    us = at(*ops.update_tiles(DK, DV))
    row: dict[str, Any] = {"batch": batch, "ours_us": us,
                           "ours_copy_fraction": state_bytes / (us * 1e-6) / copy_bw}  # fmt: skip
    if sweep:
        tiles = {f"{bv}x{w}": at(bv, w) for bv, w in TILE_SWEEP}
        best = min(tiles, key=tiles.__getitem__)
        row.update(tiles_us=tiles, best_tiles=best,
                   best_copy_fraction=state_bytes / (tiles[best] * 1e-6) / copy_bw)  # fmt: skip
    return row


def bench_prefill(lengths: list[int]) -> dict[str, Any]:
    from unified_attn.backends import gated_delta_math
    from unified_attn.backends.triton import gated_delta_ops as ops

    tokens, num = sum(lengths), len(lengths)
    inp = rule_inputs(tokens, seed=tokens)
    qsl = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                       device="cuda")  # fmt: skip
    zeros = torch.zeros(num, dtype=torch.int32, device="cuda")
    pool = torch.zeros(num + 1, HV, DK, DV, device="cuda")
    slots = torch.arange(1, num + 1, dtype=torch.int32, device="cuda")

    def ours() -> torch.Tensor:
        return ops.gated_delta_chunked_varlen(inp["q"], inp["k"], inp["v"], inp["g"],
                                              inp["beta"], qsl, zeros, pool, zeros - 1, slots,
                                              DK**-0.5, 64, l2norm=True)  # fmt: skip

    q, k = gated_delta_math.prepare_qk(inp["q"], inp["k"], HV)
    starts = qsl.tolist()

    def torch_form() -> None:
        for r in range(num):
            rows = slice(starts[r], starts[r + 1])
            gated_delta_math.gated_delta_chunked(q[rows], k[rows], inp["v"][rows], inp["g"][rows],
                                                 inp["beta"][rows], pool[0] * 0, 64)  # fmt: skip

    ms, torch_ms = gpu_ms(ours), gpu_ms(torch_form)
    return {"lengths": lengths, "ours_ms": ms, "tokens_per_s": tokens / (ms * 1e-3),
            "torch_ms": torch_ms, "torch_over_ours": torch_ms / ms}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    console = make_console(120)
    if not torch.cuda.is_available():
        raise SystemExit("gated_delta_kernels.py needs a CUDA GPU")
    out = output_dir(args)
    results: dict[str, Any] = run_header(SCHEMA, "gated_delta_kernels.py", args.quick, args.argv)
    results["shape"] = {"key_heads": HK, "value_heads": HV, "key_dim": DK, "value_dim": DV}
    results["copy_bandwidth_bytes_per_s"] = copy_bw = copy_bandwidth()
    batches = [1, 64] if args.quick else DECODE_BATCHES
    results["decode"] = [bench_decode(b, copy_bw, not args.quick) for b in batches]
    write_json(out / "gated_delta_kernels.json", results)
    results["prefill"] = [bench_prefill(lengths) for lengths in PREFILL[: 1 if args.quick else 4]]
    write_json(out / "gated_delta_kernels.json", results)
    report(console, results)
    console.print(f"wrote {out / 'gated_delta_kernels.json'}")


def report(console: Any, results: dict[str, Any]) -> None:
    t = table("decode update", ["batch", "us", "copy frac", "best tiles", "best frac"])
    for r in results["decode"]:
        t.add_row(
            str(r["batch"]),
            f"{r['ours_us']:.1f}",
            f"{r['ours_copy_fraction']:.2f}",
            r.get("best_tiles", "-"),
            f"{r.get('best_copy_fraction', float('nan')):.2f}",
        )
    console.print(t)
    t = table("prefill (token by token)", ["lengths", "ms", "Mtok/s", "torch ms", "torch/ours"])
    for r in results["prefill"]:
        t.add_row(
            str(r["lengths"]),
            f"{r['ours_ms']:.2f}",
            f"{r['tokens_per_s'] / 1e6:.2f}",
            f"{r['torch_ms']:.1f}",
            f"{r['torch_over_ours']:.1f}",
        )
    console.print(t)


if __name__ == "__main__":
    main()
