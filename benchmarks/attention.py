"""Attention-kernel benchmark on one GPU: the Triton unified paged kernel against same-run peers.

    python benchmarks/attention.py --out DIR [--quick] [--no-flex] [--no-plot] [--budget-s S]
                                   [--sections decode,prefill,window,features,split]

The benchmark lives in the `attn_bench` package next to this script; its docstring describes the
shapes, peers, timing and outputs.
"""

import sys

from attn_bench.cli import main
from attn_bench.config import SECTIONS

__all__ = ["SECTIONS", "main"]

if __name__ == "__main__":
    sys.exit(1 if main().get("interrupted") else 0)
