"""KV-cache manager micro-benchmarks (CPU, pure Python).

    python benchmarks/kv_manager.py [--quick] [--out benchmarks/results] [--profile] [--no-plot]
    python benchmarks/kv_manager.py --lookup [--quick]    # get_computed_blocks only

The benchmark lives in the `kv_bench` package next to this script; its docstring describes the
workloads, configurations and outputs.
"""

from kv_bench.cli import main
from kv_bench.plot import plot

__all__ = ["main", "plot"]

if __name__ == "__main__":
    main()
