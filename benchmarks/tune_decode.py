"""Sweep the Triton kernel's decode tile configuration on the GPU, bf16 and fp8 caches.

    python benchmarks/tune_decode.py [--shapes 64x32768,1x32768] [--kinds bf16,fp8] [--out DIR]

The shapes of `fp8_decode.py` (32 query / 8 KV heads of 128, page 16, one query token per
request, split-KV as the backend plans it). Prints TB/s per (TILE, num_warps, num_stages) next
to the shipped configuration's, measured in the same run, and writes `DIR/tune_decode.json`.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
from common import add_out_argument, gpu_ms, output_dir, write_json
from fp8_decode import FULL, Decode

from unified_attn.backends.triton import ops

SHIPPED = ops.tile_config


def fixed(cfg: ops.TileConfig, *_args: object) -> ops.TileConfig:
    return cfg


def measure(shape: Decode, kind: str, cfg: ops.TileConfig | None) -> float:
    """TB/s of one decode launch with `cfg` (None: the shipped choice)."""
    ops.tile_config = SHIPPED if cfg is None else functools.partial(fixed, cfg)
    run, _ = shape.launch(kind)
    try:
        return shape.bytes_read(kind) / gpu_ms(run) / 1e9
    except Exception as error:  # out of resources etc.
        print(f"  {cfg}: {type(error).__name__}", flush=True)
        return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="64x32768,16x8192,1x32768")
    parser.add_argument("--kinds", default="fp8,bf16")
    parser.add_argument(
        "--configs", default="", help="TILE/WARPS/STAGES[/MAXNREG],... (default: all)"
    )
    add_out_argument(parser)
    args = parser.parse_args()
    grid = list(itertools.product((32, 64, 128, 256), (2, 4, 8), (2, 3, 4)))
    try:
        shapes = [tuple(int(x) for x in text.split("x")) for text in args.shapes.split(",")]
        configs = [tuple(int(x) for x in c.split("/")) for c in args.configs.split(",") if c]
        if any(len(s) != 2 for s in shapes) or any(len(c) not in (3, 4) for c in configs):
            raise ValueError
        if not set(args.kinds.split(",")) <= {"fp8", "bf16"}:
            raise ValueError
    except ValueError:
        parser.error(
            f"--shapes takes BATCHxCTX,... (e.g. 64x32768), --kinds fp8 and/or bf16, --configs "
            f"TILE/WARPS/STAGES,... (e.g. 64/4/3); got --shapes {args.shapes!r} --kinds "
            f"{args.kinds!r} --configs {args.configs!r}"
        )
    rows = []
    for batch, ctx in shapes:
        shape = Decode(FULL, batch, ctx, torch.device("cuda"))
        for kind in args.kinds.split(","):
            shipped = measure(shape, kind, None)
            print(f"B={batch} ctx={ctx} {kind}: shipped {shipped:.2f} TB/s", flush=True)
            for config in configs or grid:
                cfg = ops.TileConfig(16, *config)
                tile, warps, stages = config[:3]
                tb_s = measure(shape, kind, cfg)
                rows.append({"batch": batch, "ctx": ctx, "kind": kind, "tile": tile,
                             "warps": warps, "stages": stages, "max_registers": cfg.max_registers,
                             "tb_s": tb_s,
                             "shipped_tb_s": shipped})  # fmt: skip
                print(f"  {cfg}: {tb_s:.2f} TB/s", flush=True)
            best = max((r for r in rows if r["kind"] == kind and r["batch"] == batch
                        and r["ctx"] == ctx), key=lambda r: r["tb_s"])  # fmt: skip
            print(f"  best {best}", flush=True)
    ops.tile_config = SHIPPED
    write_json(output_dir(args) / "tune_decode.json", rows, indent=1)


if __name__ == "__main__":
    main()
