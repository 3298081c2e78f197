"""Prefill / admission: requests with shared-prefix prompts admitted one by one on a pool that
holds all of them. Reports allocate_slots calls/s, admissions/s (lookup + allocate), the
prefix-cache hit rate and the hashing rate (building the requests), the median over repeats each
on a fresh manager."""

from __future__ import annotations

import random
import statistics
from typing import Any

from common import percentile

from .config import BLOCK_SIZE, CONFIGS, SEED
from .workloads import admit, build_requests, make_manager, make_prompts, quiesce


def bench_prefill(config_name: str, p: dict[str, Any]) -> dict[str, Any]:
    n, plen = p["prefill_requests"], p["prompt_len"]
    groups = len(CONFIGS[config_name])
    # Every request stays running: the pool holds all of them (no eviction here).
    num_blocks = n * (plen // BLOCK_SIZE + 2) * groups + 64
    rng = random.Random(SEED)
    prompts = make_prompts(rng, n, plen, p["num_prefixes"], p["prefix_len"])

    # Warm-up: a small run on a throwaway manager.
    wm = make_manager(config_name, num_blocks)
    wreqs, _ = build_requests(prompts[: min(16, n)], wm.make_block_hasher(), "w")
    for r in wreqs:
        admit(wm, r)
    del wm, wreqs

    runs = []
    for rep in range(p["prefill_repeats"]):
        m = make_manager(config_name, num_blocks)
        hasher = m.make_block_hasher()
        quiesce()
        reqs, hash_ns = build_requests(prompts, hasher, f"p{rep}-")
        quiesce()
        lookup_ns, alloc_ns = [], []
        for r in reqs:
            lk, al, _ = admit(m, r)
            lookup_ns.append(lk)
            alloc_ns.append(al)
        total_alloc = sum(alloc_ns)
        total_admit = total_alloc + sum(lookup_ns)
        runs.append(
            {
                "allocate_slots_per_s": n / (total_alloc / 1e9),
                "admissions_per_s": n / (total_admit / 1e9),
                "allocate_slots_us_median": statistics.median(alloc_ns) / 1e3,
                "allocate_slots_us_p90": percentile(alloc_ns, 90) / 1e3,
                "get_computed_blocks_us_median": statistics.median(lookup_ns) / 1e3,
                "hashing_tokens_per_s": n * plen / (hash_ns / 1e9),
                "hashing_us_per_request": hash_ns / n / 1e3,
                "hit_rate": m.prefix_cache_stats.hit_rate,
                "cached_blocks": m.block_pool.num_cached_blocks(),
                "usage": m.usage,
            }
        )
    out: dict[str, Any] = {
        k: statistics.median(run[k] for run in runs) for k in runs[0] if k != "hit_rate"
    }
    out["hit_rate"] = runs[0]["hit_rate"]  # deterministic: same prompts every repeat
    out.update(num_requests=n, prompt_len=plen, num_blocks=num_blocks, repeats=len(runs))
    out["runs"] = runs
    return out
