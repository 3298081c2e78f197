"""Churn: a small pool, distinct prompts and a few running requests; each admission frees the
oldest running request first, so every `get_new_blocks` pops a block that is still cached and
evicts it. The evictions are counted directly by peeking at the head of the free queue before each
allocation, outside the timed region."""

from __future__ import annotations

import random
import statistics
from typing import Any

from common import percentile

from unified_attn.managers import KVCacheManager
from unified_attn.request import Request

from .config import BLOCK_SIZE, CONFIGS, SEED
from .workloads import admit, build_requests, distinct_prompts, make_manager, quiesce


def _count_hashed_head(m: KVCacheManager, limit: int) -> list[bool]:
    """Whether each of the first `limit` free-queue blocks carries a hash (untimed peek)."""
    q = m.block_pool.free_block_queue
    flags = []
    block = q.head.next_free_block
    while block is not None and block is not q.tail and len(flags) < limit:
        flags.append(block.block_hash is not None)
        block = block.next_free_block
    return flags


def bench_churn(config_name: str, p: dict[str, Any]) -> dict[str, Any]:
    plen = p["prompt_len"]
    groups = len(CONFIGS[config_name])
    blocks_per_req = plen // BLOCK_SIZE * groups
    num_blocks = p["churn_pool_requests"] * blocks_per_req + 1
    running = p["churn_running"]
    n = p["churn_admissions"]
    # Enough admissions before measuring that every free block carries a hash.
    fill = p["churn_pool_requests"] + running
    runs = []
    for rep in range(p["churn_repeats"]):
        rng = random.Random(SEED + 10 + rep)
        m = make_manager(config_name, num_blocks)
        hasher = m.make_block_hasher()
        reqs, _ = build_requests(distinct_prompts(rng, fill + n, plen), hasher, f"c{rep}-")
        live: list[Request] = []

        def step(r: Request, live: list[Request] = live, m: KVCacheManager = m) -> tuple:
            if len(live) >= running:
                m.free(live.pop(0))
            cached_before = m.block_pool.num_cached_blocks()
            flags = _count_hashed_head(m, blocks_per_req)
            lk, al, new = admit(m, r)
            popped = sum(len(g) for g in new.blocks)
            live.append(r)
            return lk, al, popped, sum(flags[:popped]), cached_before

        for r in reqs[:fill]:
            step(r)
        quiesce()
        lookup_ns, alloc_ns = [], []
        popped_total = evicted_total = 0
        cached_before_measure = m.block_pool.num_cached_blocks()
        for r in reqs[fill:]:
            lk, al, popped, evicted, _ = step(r)
            lookup_ns.append(lk)
            alloc_ns.append(al)
            popped_total += popped
            evicted_total += evicted
        runs.append(
            {
                "allocate_slots_per_s": n / (sum(alloc_ns) / 1e9),
                "admissions_per_s": n / ((sum(alloc_ns) + sum(lookup_ns)) / 1e9),
                "allocate_slots_us_median": statistics.median(alloc_ns) / 1e3,
                "allocate_slots_us_p90": percentile(alloc_ns, 90) / 1e3,
                "blocks_popped": popped_total,
                "evictions": evicted_total,
                "eviction_fraction": evicted_total / popped_total if popped_total else 0.0,
                "cached_blocks_before": cached_before_measure,
                "cached_blocks_after": m.block_pool.num_cached_blocks(),
                "hit_rate": m.prefix_cache_stats.hit_rate,
            }
        )
    out: dict[str, Any] = {
        k: statistics.median(run[k] for run in runs)
        for k in ("allocate_slots_per_s", "admissions_per_s")
    }
    for k in ("allocate_slots_us_median", "allocate_slots_us_p90"):
        out[k] = statistics.median(run[k] for run in runs)
    for k in ("blocks_popped", "evictions"):
        out[k] = sum(run[k] for run in runs)
    out["eviction_fraction"] = out["evictions"] / out["blocks_popped"] if runs else 0.0
    out["cached_blocks_after"] = runs[-1]["cached_blocks_after"]
    out["hit_rate"] = runs[-1]["hit_rate"]
    out.update(
        num_blocks=num_blocks,
        admissions_per_repeat=n,
        running=running,
        prompt_len=plen,
        repeats=len(runs),
        runs=runs,
    )
    return out
