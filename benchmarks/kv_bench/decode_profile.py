"""cProfile of one decode pass (the decode section's workload), run for the hybrid configuration
with `--profile` or when a full run misses the decode target: the hot spots by cumulative and by
own time, in µs per step."""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import random
from typing import Any

from .config import SEED, VOCAB
from .decode import decode_step, prefilled

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def profile_decode(config_name: str, p: dict[str, Any], top: int = 15) -> dict[str, Any]:
    """cProfile one decode pass (same workload as `bench_decode`) and list the hot spots."""
    m, reqs = prefilled(config_name, p, "prof-")
    rng = random.Random(SEED + 3)
    for _ in range(p["decode_warmup_steps"]):
        decode_step(m, reqs, rng.randrange(VOCAB))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(p["decode_steps"]):
        decode_step(m, reqs, rng.randrange(VOCAB))
    prof.disable()
    stats = pstats.Stats(prof)
    total = stats.total_tt  # type: ignore[attr-defined]

    def rows(key: str) -> list[dict[str, Any]]:
        entries = []
        for (file, line, func), (cc, nc, tt, ct, _) in stats.stats.items():  # type: ignore[attr-defined]
            entries.append(
                {
                    "function": f"{_short(file)}:{line}({func})",
                    "ncalls": nc,
                    "primitive_calls": cc,
                    "tottime_s": tt,
                    "cumtime_s": ct,
                    "cum_us_per_step": ct / p["decode_steps"] * 1e6,
                    "tot_us_per_step": tt / p["decode_steps"] * 1e6,
                }
            )
        entries.sort(key=lambda e: e[key], reverse=True)
        return entries[:top]

    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(top)
    return {
        "config": config_name,
        "steps": p["decode_steps"],
        "num_requests": p["decode_requests"],
        "profiled_total_s": total,
        "profiled_us_per_step": total / p["decode_steps"] * 1e6,
        "note": "cProfile adds overhead; use for relative weight, not absolute time",
        "by_cumulative": rows("cumtime_s"),
        "by_tottime": rows("tottime_s"),
        "pstats_text": text.getvalue(),
    }


def _short(file: str) -> str:
    """A profiled function's file, relative to the repository for this package and the library."""
    path = os.path.abspath(file)
    if os.path.dirname(path) == _PACKAGE_DIR:
        return f"benchmarks/kv_bench/{os.path.basename(path)}"
    marker = "unified_attn" + os.sep
    if marker in file:
        return file[file.rindex(marker) :]
    return os.path.basename(file) if os.sep in file else file
