"""Why fp8 decode is not twice as fast: launch the decode kernel of `fp8_decode.py`'s shape
(batch 64, 32k, 32q/8kv/d128, page 16) over the bf16 and the fp8 cache with a given tile,
and write each compiled kernel's PTX / TTGIR and resource use to DIR (run under `ncu` for the
hardware counters).

    python benchmarks/profile_fp8_decode.py --out DIR [--tile 128 --warps 4 --stages 3]
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
from fp8_decode import FULL, Decode

from unified_attn.backends.triton import ops


class Capture:
    """Wraps a JIT kernel: `kernel[grid](...)` launches and records the compiled kernel."""

    def __init__(self, kernel):
        self.kernel, self.compiled = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.compiled.append(self.kernel[grid](*args, **kwargs))
            return self.compiled[-1]

        return launch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tile", type=int, default=128)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=32768)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = ops.TileConfig(16, args.tile, args.warps, args.stages)
    ops.tile_config = functools.partial(lambda cfg, *_: cfg, cfg)
    capture = Capture(ops.unified_attention_kernel)
    ops.unified_attention_kernel = capture
    shape = Decode(FULL, args.batch, args.ctx, torch.device("cuda"))
    info = {}
    for kind in ("bf16", "fp8"):
        run, _ = shape.launch(kind)
        run()
        torch.cuda.synchronize()
        kernel = capture.compiled[-1]
        for name in ("ptx", "ttgir"):
            (out / f"{kind}.{name}").write_text(kernel.asm[name])
        info[kind] = {k: getattr(kernel, k, None) for k in ("n_regs", "n_spills")}
        info[kind]["shared"] = kernel.metadata.shared
        for _ in range(3):  # the launches ncu profiles
            run()
        torch.cuda.synchronize()
    (out / "kernels.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info))


if __name__ == "__main__":
    main()
