"""Tile sweep of the decode-row GEMM (`kernels/layers/skinny_gemm.py`) on one GPU, bf16, at
Llama-3-8B's four projections (q/k/v 6144 x 4096, o 4096 x 4096, gate/up 28672 x 4096, down
4096 x 14336) and 1, 4, 16 and 64 rows.

Each tile (BLOCK_N output columns, BLOCK_K chunk, warps, stages) runs over 32 distinct weights
of the shape captured in one CUDA graph (no weight is in L2 when its GEMM starts, as in a decode
step), after a check of its output against `torch.matmul` (bf16: another accumulation order).
Prints per shape and row count the default tiles' time (`skinny_tiles`), the best tiles' and
the cuBLAS chain's, all as a fraction of the weights' bytes at the device-to-device copy
bandwidth measured in the same run; then the best tiles per shape over all row counts
(geometric mean of time / default time), what `skinny_tiles` should return.

    python benchmarks/tune_skinny_gemm.py [--rows 1,4,16,64] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton
from common import capture_graph, csv_ints, graph_replay_ms, warm_up_gpu
from model_step_device import copy_bandwidth

from unified_attn.kernels.layers.skinny_gemm import MAX_ROWS, Tiles, skinny_linear, skinny_tiles

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS = 32
BLOCK_N, BLOCK_K, WARPS, STAGES = (16, 32, 64), (128, 256, 512, 1024), (2, 4, 8), (2, 3, 4, 6)
QUICK = {"block_n": (32, 64), "block_k": (256, 512), "warps": (4, 8), "stages": (3, 4)}
TOLERANCE = 2e-2  # bf16 output, float32 accumulation in another order


def candidates(quick: bool) -> list[Tiles]:
    """Every tile of the sweep (the quick grid: 16 around the defaults)."""
    if quick:
        grid = (QUICK["block_n"], QUICK["block_k"], QUICK["warps"], QUICK["stages"])
    else:
        grid = (BLOCK_N, BLOCK_K, WARPS, STAGES)
    return list(itertools.product(*grid))


def time_chain(gemm: Callable[[torch.Tensor], Any], weights: list[torch.Tensor]) -> float:
    """ms per GEMM of `gemm` over every weight, captured in one graph."""
    graph = capture_graph([lambda: [gemm(w) for w in weights]])
    return graph_replay_ms(graph) / len(weights)


def sweep_shape(name: str, rows: int, tiles: list[Tiles], copy_bw: float) -> dict[str, Any]:
    n, k = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    weights = [(0.02 * torch.randn(n, k, generator=gen, device="cuda")).bfloat16()
               for _ in range(LAYERS)]  # fmt: skip
    x = torch.randn(rows, k, generator=gen, device="cuda").bfloat16()
    want = torch.matmul(x, weights[0].t()).float()
    default = skinny_tiles(n, k, torch.bfloat16, max(16, triton.next_power_of_2(rows)))
    ms: dict[str, float] = {"cublas": time_chain(lambda w: torch.matmul(x, w.t()), weights)}
    for t in [default, *[t for t in tiles if t != default]]:
        try:
            got = skinny_linear(x, weights[0], tiles=t).float()
            torch.cuda.synchronize()
        except Exception as exc:  # a tile the compiler refuses (shared memory, registers)
            if "illegal memory access" in str(exc):  # the CUDA context is lost: stop here
                raise SystemExit(f"{name} rows {rows} tiles {t}: illegal memory access") from exc
            print(f"  {name} rows {rows} tiles {t}: {type(exc).__name__}: {str(exc)[:80]}")
            continue
        diff = ((got - want).abs().max() / want.abs().max()).item()
        if diff > TOLERANCE:
            raise AssertionError(f"{name} rows {rows} tiles {t}: differs from torch by {diff}")
        ms[_name(t)] = time_chain(lambda w, t=t: skinny_linear(x, w, tiles=t), weights)
    ideal = 2 * n * k / copy_bw * 1e3
    best = min((key for key in ms if key != "cublas"), key=ms.__getitem__)
    return {"shape": name, "rows": rows, "ms": ms, "default": _name(default), "best": best,
            "ideal_ms": ideal}  # fmt: skip


def _name(tiles: Tiles) -> str:
    return "n{}_k{}_w{}_s{}".format(*tiles)


def report(results: list[dict[str, Any]]) -> None:
    for r in results:
        ms, ideal = r["ms"], r["ideal_ms"]
        print(f"{r['shape']:8s} rows {r['rows']:2d}: default {r['default']} "
              f"{ideal / ms[r['default']]:.0%}, best {r['best']} {ideal / ms[r['best']]:.0%}, "
              f"cuBLAS {ideal / ms['cublas']:.0%} of the copy time")  # fmt: skip
    for shape in SHAPES:
        rows = [r for r in results if r["shape"] == shape]
        if not rows:
            continue
        common = set.intersection(*(set(r["ms"]) for r in rows)) - {"cublas"}
        score = {key: math.exp(sum(math.log(r["ms"][key] / r["ms"][r["default"]]) for r in rows)
                               / len(rows)) for key in common}  # fmt: skip
        best = min(score, key=score.__getitem__)
        print(f"{shape}: best over the row counts {best} ({score[best]:.2f}x the default's time)")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=csv_ints, default=[1, 4, 16, MAX_ROWS],
                        help=f"decode row counts, 1 to {MAX_ROWS}, comma-separated")  # fmt: skip
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help=f"comma-separated, any of {', '.join(SHAPES)}")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="16 tiles around the defaults")
    args = parser.parse_args(argv)
    if max(args.rows) > MAX_ROWS:
        parser.error(f"--rows: at most {MAX_ROWS} (the decode-row GEMM's limit), got "
                     f"{max(args.rows)}")  # fmt: skip
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = sorted(set(args.shapes) - set(SHAPES)) or ([] if args.shapes else ["(none)"])
    if unknown:
        parser.error(f"--shapes: expected any of {', '.join(SHAPES)}, got {', '.join(unknown)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/tune_skinny_gemm.py needs a CUDA GPU", file=sys.stderr)
        raise SystemExit(2)
    warm_up_gpu()
    copy_bw = copy_bandwidth(torch.device("cuda"))
    tiles = candidates(args.quick)
    results = []
    for shape in args.shapes:
        for rows in args.rows:
            results.append(sweep_shape(shape, rows, tiles, copy_bw))
            print(f"  done {shape} rows {rows}", flush=True)
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
