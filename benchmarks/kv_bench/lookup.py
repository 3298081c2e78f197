"""Prefix-cache lookup: `get_computed_blocks` per admission, for full attention alone and full +
sliding window (128 and 1,024), at 1k and 4k-token prompts.

One cached request per (configuration, prompt length), finished (its blocks free but cached),
then waiting requests are looked up many times (a lookup changes nothing but the hit
statistics). Cases:

* `prefix`: the first 7/8 of the prompt is the cached request's (a shared system prompt);
* `miss`: nothing cached;
* `shifted` (hybrids only): as `prefix`, but the sliding group's blocks of the last quarter of
  the shared prefix were evicted, so its right-to-left search walks back, shrinks the hit and
  the coordinator iterates.

Every round times each variant once, in a shuffled order (noise spreads over all of them);
reported: mean, median and min µs per call, the hit in tokens, and each hybrid's median over
full attention's at the same prompt length and case (`per_group`: that ratio over 2 groups).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from unified_attn.managers import (
    FullAttentionManager,
    KVCacheManager,
    SchedulerKVCacheConfig,
    SlidingWindowManager,
)
from unified_attn.request import Request

from .config import BLOCK_SIZE, MAX_MODEL_LEN, SEED, VOCAB
from .workloads import quiesce

FULL = (FullAttentionManager, FullAttentionManager.Config())
LOOKUP_CONFIGS: dict[str, list[tuple[type, Any]]] = {
    "full": [FULL],
    "full_swa128": [FULL, (SlidingWindowManager, SlidingWindowManager.Config(sliding_window=128))],
    "full_swa1024": [
        FULL,
        (SlidingWindowManager, SlidingWindowManager.Config(sliding_window=1024)),
    ],
}
LOOKUP_PROMPT_LENS = (1024, 4096)
SHARED_FRACTION = 7 / 8
LOOKUP_PARAMS = {
    "full": {"lookup_rounds": 3000, "lookup_warmup": 50},
    "quick": {"lookup_rounds": 200, "lookup_warmup": 10},
}


def _prompt(rng: random.Random, n: int) -> list[int]:
    return rng.choices(range(VOCAB), k=n)


def _cached_manager(config_name: str, seed_prompt: list[int]) -> KVCacheManager:
    """A manager whose pool holds `seed_prompt` cached in every group, all blocks free."""
    groups = LOOKUP_CONFIGS[config_name]
    num_blocks = 4 * (MAX_MODEL_LEN // BLOCK_SIZE + 2) * len(groups)
    m = KVCacheManager(SchedulerKVCacheConfig(num_blocks, BLOCK_SIZE, groups), MAX_MODEL_LEN)
    seed = Request("seed", seed_prompt, block_hasher=m.make_block_hasher())
    if m.allocate_slots(seed, seed.num_tokens) is None:
        raise RuntimeError("lookup benchmark: pool too small for the cached request")
    m.free(seed)
    return m


def _evict_sliding_tail(m: KVCacheManager, seed_prompt: list[int], num_shared: int) -> None:
    """Evict the sliding group's cached blocks in the last quarter of the shared blocks."""
    probe = Request("probe", seed_prompt, block_hasher=m.make_block_hasher())
    tail = probe.block_hashes[num_shared - num_shared // 4 : num_shared]
    found = [m.block_pool.get_cached_block(h, (1,)) for h in tail]
    m.evict_blocks(hit[0].block_id for hit in found if hit is not None)


def lookup_variants(
    config_name: str, prompt_len: int, rng: random.Random
) -> dict[str, tuple[KVCacheManager, Request]]:
    """`case -> (manager, waiting request)` for one configuration and prompt length."""
    seed_prompt = _prompt(rng, prompt_len)
    num_shared = int(prompt_len * SHARED_FRACTION) // BLOCK_SIZE
    shared = seed_prompt[: num_shared * BLOCK_SIZE]
    tail = _prompt(rng, prompt_len - len(shared))
    prompts = {"prefix": shared + tail, "miss": _prompt(rng, prompt_len)}
    managers = {"prefix": _cached_manager(config_name, seed_prompt)}
    managers["miss"] = managers["prefix"]
    if len(LOOKUP_CONFIGS[config_name]) > 1:
        prompts["shifted"] = prompts["prefix"]
        managers["shifted"] = _cached_manager(config_name, seed_prompt)
        _evict_sliding_tail(managers["shifted"], seed_prompt, num_shared)
    out = {}
    for case, prompt in prompts.items():
        m = managers[case]
        out[case] = (m, Request(f"w-{case}", prompt, block_hasher=m.make_block_hasher()))
    return out


def bench_lookup(p: dict[str, Any]) -> dict[str, Any]:
    """µs per `get_computed_blocks` for every configuration, prompt length and case."""
    rng = random.Random(SEED + 20)
    variants = {
        (name, plen, case): mr
        for name in LOOKUP_CONFIGS
        for plen in LOOKUP_PROMPT_LENS
        for case, mr in lookup_variants(name, plen, rng).items()
    }
    samples: dict[tuple, list[int]] = {key: [] for key in variants}
    hits = {key: m.get_computed_blocks(r)[1] for key, (m, r) in variants.items()}
    order = list(variants)
    for _ in range(p["lookup_warmup"]):
        for m, r in variants.values():
            m.get_computed_blocks(r)
    quiesce()
    perf = time.perf_counter_ns
    for _ in range(p["lookup_rounds"]):
        rng.shuffle(order)
        for key in order:
            m, r = variants[key]
            t0 = perf()
            m.get_computed_blocks(r)
            samples[key].append(perf() - t0)
    rows = [_row(key, samples[key], hits[key]) for key in variants]
    return {
        "rounds": p["lookup_rounds"],
        "shared_fraction": SHARED_FRACTION,
        "rows": rows,
        "ratios": _ratios(rows),
    }


def _row(key: tuple, ns: list[int], hit: int) -> dict[str, Any]:
    name, plen, case = key
    return {
        "config": name,
        "prompt_len": plen,
        "case": case,
        "hit_tokens": hit,
        "mean_us": statistics.fmean(ns) / 1e3,
        "median_us": statistics.median(ns) / 1e3,
        "min_us": min(ns) / 1e3,
    }


def _ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each hybrid row against full attention at the same prompt length and case (medians)."""
    full = {(r["prompt_len"], r["case"]): r for r in rows if r["config"] == "full"}
    out = []
    for r in rows:
        base = full.get((r["prompt_len"], r["case"]))
        if r["config"] == "full" or base is None:
            continue
        ratio = r["median_us"] / base["median_us"]
        out.append(
            {
                "config": r["config"],
                "prompt_len": r["prompt_len"],
                "case": r["case"],
                "hybrid_over_full": ratio,
                "per_group": ratio / 2,
            }
        )
    return out
