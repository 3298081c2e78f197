"""Sweep the Triton kernel's prefill tile configuration on the GPU (causal, 32q/8kv/d128, bf16).

    python benchmarks/tune_prefill.py [--lens 8192] [--pages 16,64] [--chunk 512x32768]
                                      [--out DIR]

Prints TFLOP/s per (BLOCK_M, TILE, num_warps, num_stages) and page size next to SDPA flash
measured in the same run (on the same number of queries and keys), and writes
`DIR/tune_prefill.json`. `--chunk QxC` adds a chunked prefill: Q queries after C cached keys.
"""

from __future__ import annotations

import argparse
import functools
import itertools

from common import (
    add_out_argument,
    gpu_ms,
    output_dir,
    prefill_case,
    prefill_flops,
    sdpa_prefill,
    write_json,
)

from unified_attn.backends.triton import ops

SHIPPED = ops.tile_config
CONFIGS = list(itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)))


def fixed(cfg: ops.TileConfig, *_args: object, **_kwargs: object) -> ops.TileConfig:
    return cfg


def sweep(
    length: int, context: int, page: int, flash: float, configs: list[tuple[int, ...]]
) -> list[dict]:
    rows = []
    flops = prefill_flops(length, context)
    ops.tile_config = SHIPPED
    shipped_launch = prefill_case(length, context=context, page=page)["launch"]
    shipped = flops / gpu_ms(shipped_launch) / 1e9
    print(f"L={length} context={context} page={page}: shipped {shipped:.1f} TFLOP/s, SDPA "
          f"flash {flash:.1f} ({shipped / flash:.2f}x)", flush=True)  # fmt: skip
    for config in configs:
        cfg = ops.TileConfig(*config)
        bm, tile, warps, stages = config[:4]
        ops.tile_config = functools.partial(fixed, cfg)
        try:
            tflops = flops / gpu_ms(shipped_launch) / 1e9
        except Exception as error:  # out of resources etc.
            tflops = float("nan")
            print(f"  {cfg}: {type(error).__name__}", flush=True)
        rows.append({"len": length, "context": context, "page": page, "block_m": bm,
                     "tile": tile, "warps": warps, "stages": stages,
                     "max_registers": cfg.max_registers, "tflops": tflops,
                     "shipped_tflops": shipped, "flash_tflops": flash})  # fmt: skip
        print(f"  BLOCK_M={bm} TILE={tile} warps={warps} stages={stages}: {tflops:.1f} "
              f"({tflops / flash:.2f}x flash)", flush=True)  # fmt: skip
    ops.tile_config = SHIPPED
    best = max(rows, key=lambda r: r["tflops"] if r["tflops"] == r["tflops"] else -1)
    print(f"  best {best}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lens", default="8192")
    parser.add_argument("--pages", default="16,64")
    parser.add_argument("--chunk", default="", help="QxC: Q queries after C cached keys")
    parser.add_argument(
        "--configs",
        default="",
        help="BLOCK_M/TILE/WARPS/STAGES[/MAXNREG],... (default: the full grid)",
    )
    add_out_argument(parser)
    args = parser.parse_args()
    try:
        cases = [(int(x), 0) for x in args.lens.split(",") if x]
        pages = [int(x) for x in args.pages.split(",")]
        if args.chunk:
            q, c = (int(x) for x in args.chunk.split("x"))
            cases.append((q, c))
        configs = [tuple(int(x) for x in c.split("/")) for c in args.configs.split(",") if c]
        if any(len(c) not in (4, 5) for c in configs):
            raise ValueError
    except ValueError:
        parser.error(
            f"--lens and --pages take comma-separated integers, --chunk QxC (e.g. 512x32768) "
            f"and --configs M/TILE/WARPS/STAGES,... (e.g. 64/64/4/3), got --lens {args.lens!r} "
            f"--pages {args.pages!r} --chunk {args.chunk!r} --configs {args.configs!r}"
        )
    rows = []
    for length, context in cases:
        peers = sdpa_prefill(prefill_case(length, context=context), context)
        flash = peers["sdpa_flash"]["tflops"]
        for page in pages:
            rows += sweep(length, context, page, flash, configs or CONFIGS)
    write_json(output_dir(args) / "tune_prefill.json", rows, indent=1)


if __name__ == "__main__":
    main()
