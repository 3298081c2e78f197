"""Tile sweep of the Mamba-2 chunked scan (`ssm_ops.ScanTiles`: `chunk_scan_kernel` and
`chunk_state_kernel`) on one GPU, bfloat16 inputs, float32 states, at the shapes of
`ssm_kernels.py` (Nemotron-H-8B: 8 groups, chunk 128; Granite-4.0-H-Small: 1 group, chunk 256)
and its prefill lengths (2k, 8k, 4 x 512, 4 x 2k). The two kernels are swept one at a time
(the other at its default tiles); every tile's output is checked against the default's (max
relative difference, bf16) and its time taken by `triton.testing.do_bench` over the whole scan.
Prints the time of every tile, the best per shape and the best over all shapes (geometric mean
of time / default time); `ssm_ops.ScanTiles` takes the winners as its defaults.

    python benchmarks/tune_ssm_scan.py [--models nemotron_h_8b,granite_4_h_small] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections.abc import Sequence
from typing import Any

import attrs
import torch
from common import gpu_ms, warm_up_gpu
from ssm_kernels import MODELS, PREFILL, scan_inputs

SCAN_FIELDS = {"scan_m": (32, 64, 128), "scan_p": (32, 64), "scan_n": (64, 128),
               "scan_warps": (4, 8), "scan_stages": (1, 2)}  # fmt: skip
STATE_FIELDS = {"state_p": (32, 64), "state_n": (64, 128), "state_l": (32, 64),
                "state_warps": (4, 8)}  # fmt: skip
TOLERANCE = 2e-2  # bf16 inputs, float32 accumulation in another order


def candidates(fields: dict[str, tuple[int, ...]], chunk: int) -> list[Any]:
    """Every combination of `fields` over the default `ScanTiles` (rows at most the chunk)."""
    from unified_attn.backends.triton.ssm_ops import ScanTiles

    names = list(fields)
    out = []
    for values in itertools.product(*(fields[n] for n in names)):
        tiles = attrs.evolve(ScanTiles(), **dict(zip(names, values, strict=True)))
        if tiles.scan_m <= chunk and tiles.state_l <= chunk:
            out.append(tiles)
    return out


def sweep_shape(model: tuple[int, ...], lengths: list[int]) -> dict[str, Any]:
    from unified_attn.backends.triton import ssm_ops

    chunk = model[5]
    inp = scan_inputs(model, lengths)
    args = [inp[k] for k in ("x", "dt", "dt_bias", "A", "B", "C", "D")]

    def run(tiles: Any) -> torch.Tensor:
        y = torch.empty_like(inp["x"])
        ssm_ops._launch_scan(*args, inp["qsl"], inp["offsets"], inp["pool"], inp["none"],
                             inp["slots"], None, chunk, 0.0, math.inf, y, tiles)  # fmt: skip
        return y

    default = ssm_ops.ScanTiles()
    want = run(default).float()
    warm_up_gpu()  # timed first on an idle GPU the default read 2.4x slow
    times: dict[str, float] = {"default": gpu_ms(lambda: run(default))}
    for tiles in candidates(SCAN_FIELDS, chunk) + candidates(STATE_FIELDS, chunk):
        name = _name(tiles, default)
        if name in times:
            continue
        try:
            got = run(tiles)
            torch.cuda.synchronize()
        except Exception as exc:  # a tile the compiler refuses (shared memory, registers)
            if "illegal memory access" in str(exc):  # the CUDA context is lost: stop here
                raise SystemExit(f"tiles {name}: illegal memory access (a compiler fault at "
                                 f"this tile); the sweep so far: {times}") from exc  # fmt: skip
            print(f"  {name}: {type(exc).__name__}: {str(exc)[:80]}")
            continue
        diff = ((got.float() - want).abs().max() / want.abs().max()).item()
        if diff > TOLERANCE:
            raise AssertionError(f"tiles {name}: output differs from the default's by {diff}")
        times[name] = gpu_ms(lambda t=tiles: run(t))
    times["default"] = min(times["default"], gpu_ms(lambda: run(default)))  # again, last
    best = min(times, key=times.__getitem__)
    return {"lengths": lengths, "ms": times, "best": best,
            "best_over_default": times[best] / times["default"]}  # fmt: skip


def _name(tiles: Any, default: Any) -> str:
    changed = {k: v for k, v in attrs.asdict(tiles).items() if v != getattr(default, k)}
    return ",".join(f"{k}={v}" for k, v in changed.items()) or "default"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--quick", action="store_true", help="2k tokens only")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/tune_ssm_scan.py needs a CUDA GPU", file=sys.stderr)
        raise SystemExit(2)
    for name in args.models.split(","):
        rows = [sweep_shape(MODELS[name], lengths)
                for lengths in (PREFILL[:1] if args.quick else PREFILL)]  # fmt: skip
        for row in rows:
            ranked = sorted(row["ms"].items(), key=lambda kv: kv[1])
            print(f"{name} {row['lengths'][:2]}{'...' if len(row['lengths']) > 2 else ''}: "
                  f"default {row['ms']['default']:.3f} ms, best {row['best']} "
                  f"({row['best_over_default']:.2f}x the time)")  # fmt: skip
            print("   " + "  ".join(f"{k}: {v:.3f}" for k, v in ranked[:8]))
        common = set.intersection(*(set(r["ms"]) for r in rows))
        score = {k: math.exp(sum(math.log(r["ms"][k] / r["ms"]["default"]) for r in rows)
                             / len(rows)) for k in common}  # fmt: skip
        overall = min(score, key=score.__getitem__)
        print(f"{name}: best over all shapes {overall} ({score[overall]:.2f}x the default's time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
