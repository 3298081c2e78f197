"""Sweep the Triton kernel's prefill tile configuration on the GPU (causal, 32q/8kv/d128, bf16).

    python benchmarks/tune_prefill.py [--lens 8192] [--out DIR]

Prints TFLOP/s per (BLOCK_M, TILE, num_warps, num_stages) next to SDPA flash measured in the
same run, and writes `DIR/tune_prefill.json`.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
from common import HEAD, HKV, HQ, add_out_argument, gpu_ms, output_dir, prefill_launch, write_json

from unified_attn.backends.triton import ops


def fixed(cfg: ops.TileConfig, *_args: object) -> ops.TileConfig:
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lens", default="8192")
    add_out_argument(parser)
    args = parser.parse_args()
    rows = []
    for length in [int(x) for x in args.lens.split(",")]:
        q, ours = prefill_launch(length)
        flops = 4 * HQ * HEAD * length * (length + 1) / 2
        qh = q.transpose(0, 1)[None]
        kh = torch.randn(1, HKV, length, HEAD, device="cuda", dtype=torch.bfloat16)
        sdpa = functools.partial(
            torch.nn.functional.scaled_dot_product_attention, qh, kh, kh, is_causal=True,
            enable_gqa=True,
        )  # fmt: skip
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            flash = flops / gpu_ms(sdpa) / 1e9
        print(f"L={length} SDPA flash {flash:.1f} TFLOP/s", flush=True)
        for bm, tile, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)):
            cfg = ops.TileConfig(bm, tile, warps, stages)
            ops.tile_config = functools.partial(fixed, cfg)
            try:
                tflops = flops / gpu_ms(ours) / 1e9
            except Exception as error:  # out of resources etc.
                tflops = float("nan")
                print(f"  {cfg}: {type(error).__name__}", flush=True)
            rows.append({"len": length, "block_m": bm, "tile": tile, "warps": warps,
                         "stages": stages, "tflops": tflops, "flash_tflops": flash})  # fmt: skip
            print(f"  BLOCK_M={bm} TILE={tile} warps={warps} stages={stages}: {tflops:.1f} "
                  f"({tflops / flash:.2f}x flash)", flush=True)  # fmt: skip
    write_json(output_dir(args) / "tune_prefill.json", rows, indent=1)


if __name__ == "__main__":
    main()
