"""One launch of each DeepSeek-V4 partial (window, compressed) per kernel configuration at the
`v4_decode.py` shape, each after a warm-up launch, for `ncu`:

    ncu --clock-control none --kernel-name regex:gathered_attention_kernel \\
        --section SpeedOfLight --section WarpStateStats --section Occupancy \\
        python benchmarks/profile_v4_decode.py --configs 32/64/8/3/1

(`results/ncu_v4_gathered_h100.txt`). Configurations as `v4_decode.py --configs`; `--hopper
TILE/STAGES/SPLITS,...` profiles the sm90 kernel instead (kernel name `gathered_attention_sm90`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import v4_decode

from unified_attn.backends.triton.v4_ops import Sm90GatherConfig


def parse_hopper(text: str) -> list[Sm90GatherConfig]:
    """`TILE/STAGES/SPLITS[/HALVES],...`; one line and exit 2 when malformed."""
    try:
        fields = [[int(x) for x in c.split("/")] for c in text.split(",")]
        if any(not 3 <= len(f) <= 4 for f in fields):
            raise ValueError("3 or 4 fields per configuration")
        return [Sm90GatherConfig(*f) for f in fields]
    except ValueError as error:
        print(f"--hopper takes TILE/STAGES/SPLITS[/HALVES],..., got {text!r}: {error}",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2) from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--configs", default="32/64/8/3/1", help="as v4_decode.py --configs")
    parser.add_argument("--hopper", default="", help="sm90 kernel: TILE/STAGES/SPLITS[/HALVES],...")
    args = parser.parse_args(argv)
    configs: list[Any] = list(v4_decode.parse_configs(args.configs))
    if args.hopper:
        configs = parse_hopper(args.hopper)
    if not torch.cuda.is_available():
        print("benchmarks/profile_v4_decode.py needs a CUDA GPU", file=sys.stderr)
        raise SystemExit(2)
    shape = argparse.Namespace(batch=64, context=65536, heads=64, head_size=512, window=128,
                               rate=4, topk=512, page=64, rotations=1)  # fmt: skip
    steps = v4_decode.make_case(shape)
    for config in configs:
        cfg = config if isinstance(config, Sm90GatherConfig) else v4_decode.gather_config_of(config)
        calls = v4_decode.launches(steps, shape.head_size**-0.5, cfg)["triton"]
        for name in ("swa", "compressed"):
            for _ in range(2):  # compile and warm up, then the profiled launch
                calls[name][0]()
                torch.cuda.synchronize()
        print(f"profiled {cfg}", flush=True)


if __name__ == "__main__":
    main()
