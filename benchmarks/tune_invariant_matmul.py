"""Tile configurations of the batch-invariant Triton matmul on the GPU: speed against torch
(cuBLAS) at a decode and a prefill row count, and whether every configuration gives the same
bits as the shipped one (when they all do, the tile may follow the row count without breaking
batch invariance: an element's K reduction is the same instruction sequence).

    python benchmarks/tune_invariant_matmul.py [--rows 64,8192] [--out DIR]

Shapes: the linear layers of `bench-llama-1b` (hidden 2048, MLP 8192, 8 KV heads of 64,
vocabulary 32000), bf16. Writes `DIR/tune_invariant_matmul.json`.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import attrs
import torch
from common import add_out_argument, gpu_ms, output_dir, write_json

from unified_attn.kernels.invariant import invariant_launch as triton_ops
from unified_attn.kernels.invariant.invariant_launch import MatmulConfig

SHAPES = [(2048, 2048), (512, 2048), (8192, 2048), (2048, 8192), (32000, 2048)]  # (N, K)


def candidates() -> list[MatmulConfig]:
    out = []
    for bm, bn, bk, warps, stages in itertools.product(
        (64, 128), (64, 128, 256), (64,), (4, 8), (3, 4)
    ):
        if bm * bn >= 128 * 256 and warps == 4:
            continue
        out.append(MatmulConfig(bm, bn, bk, 8, warps, stages))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="64,8192")
    add_out_argument(parser)
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for n, k in SHAPES:
        w = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).bfloat16()
        x = torch.randn(max(rows_list), k, device="cuda", generator=gen).bfloat16()
        shipped = triton_ops.matmul(x, w.t())
        for m in rows_list:
            torch_ms = gpu_ms(functools.partial(torch.nn.functional.linear, x[:m], w))
            ship_ms = gpu_ms(functools.partial(triton_ops.matmul, x[:m], w.t()))
            print(f"N={n} K={k} M={m}: torch {torch_ms:.4f} ms, shipped {ship_ms:.4f} "
                  f"({torch_ms / ship_ms:.2f}x)", flush=True)  # fmt: skip
            for cfg in candidates():
                try:
                    same = torch.equal(triton_ops.matmul(x, w.t(), config=cfg), shipped)
                    ms = gpu_ms(functools.partial(triton_ops.matmul, x[:m], w.t(), config=cfg))
                except Exception as error:  # out of resources
                    print(f"  {cfg}: {type(error).__name__}", flush=True)
                    continue
                results.append({"n": n, "k": k, "m": m, "config": attrs.asdict(cfg), "ms": ms,
                                "torch_ms": torch_ms, "shipped_ms": ship_ms,
                                "same_bits": same})  # fmt: skip
                print(f"  {cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} "
                      f"s{cfg.num_stages}: {ms:.4f} ms ({torch_ms / ms:.2f}x torch) "
                      f"same bits {same}", flush=True)  # fmt: skip
    write_json(output_dir(args) / "tune_invariant_matmul.json", results, indent=1)


if __name__ == "__main__":
    main()
