"""Sweep the Triton kernel's prefill tile configuration on the GPU (causal, 32q/8kv/d128, bf16).

    python benchmarks/tune_prefill.py [--lens 8192] [--out DIR]

Prints TFLOP/s per (BLOCK_M, TILE, num_warps, num_stages) next to SDPA flash measured in the
same run, and writes `DIR/tune_prefill.json`.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from pathlib import Path

import torch
import triton

from unified_attn.backends.triton import ops


def fixed(cfg: ops.TileConfig, *_args: object) -> ops.TileConfig:
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lens", default="8192")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    hq, hkv, d, bs = 32, 8, 128, 16
    rows = []
    for length in [int(x) for x in args.lens.split(",")]:
        nb = length // bs + 1
        cache = torch.randn(nb + 1, 2, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(nb, device="cuda").to(torch.int32)[None] + 1
        q = torch.randn(length, hq, d, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        qsl = torch.tensor([0, length], dtype=torch.int32, device="cuda")
        seq = torch.tensor([length], dtype=torch.int32, device="cuda")
        flops = 4 * hq * d * length * (length + 1) / 2
        qh = q.transpose(0, 1)[None]
        kh = torch.randn(1, hkv, length, d, device="cuda", dtype=torch.bfloat16)
        sdpa = functools.partial(
            torch.nn.functional.scaled_dot_product_attention, qh, kh, kh, is_causal=True,
            enable_gqa=True,
        )  # fmt: skip
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            flash = flops / triton.testing.do_bench(sdpa, return_mode="median") / 1e9
        print(f"L={length} SDPA flash {flash:.1f} TFLOP/s", flush=True)
        ours = functools.partial(
            ops.unified_attention, q, cache[:, 0], cache[:, 1], out, query_start_loc=qsl,
            seq_lens=seq, block_table=table, num_seqs=1, max_query_len=length, scale=d**-0.5,
        )  # fmt: skip
        for bm, tile, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)):
            cfg = ops.TileConfig(bm, tile, warps, stages)
            ops.tile_config = functools.partial(fixed, cfg)
            try:
                tflops = flops / triton.testing.do_bench(ours, return_mode="median") / 1e9
            except Exception as error:  # out of resources etc.
                tflops = float("nan")
                print(f"  {cfg}: {type(error).__name__}", flush=True)
            rows.append({"len": length, "block_m": bm, "tile": tile, "warps": warps,
                         "stages": stages, "tflops": tflops, "flash_tflops": flash})  # fmt: skip
            print(f"  BLOCK_M={bm} TILE={tile} warps={warps} stages={stages}: {tflops:.1f} "
                  f"({tflops / flash:.2f}x flash)", flush=True)  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "tune_prefill.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
