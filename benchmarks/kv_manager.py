"""KV-cache manager micro-benchmarks (CPU, pure Python).

    python benchmarks/kv_manager.py [--quick] [--out benchmarks/results] [--profile] [--no-plot]

Workloads (block size 16, fixed seeds, `time.perf_counter_ns`, warm-up before measuring):

* prefill/admission: requests with 1,024-token prompts sharing 4 system prefixes (512 tokens)
  plus random 512-token suffixes, admitted one by one with `get_computed_blocks` +
  `allocate_slots`. Reports allocate_slots calls/s, admissions/s, the prefix-cache hit rate and
  the hashing rate (building `Request` objects with the block hasher), measured separately.
* decode: 256 running requests after their prefill, 64 decode steps; per step
  `new_step_starts()`, then for every request: append one token, `allocate_slots(r, 1)`,
  `num_computed_tokens += 1`. Reports µs per step (all requests): median, p90, mean, max.
* churn: a small pool, distinct prompts, requests admitted and freed continuously so every
  `get_new_blocks` evicts a cached block. Reports allocate_slots calls/s and evictions (blocks
  popped from the free queue that still carried a hash, counted directly by peeking the queue
  head before each allocation, outside the timed region).
* block pool: `BlockPool(N)` for N in 1k, 10k, 100k: `get_new_blocks(k)` / `free_blocks` in
  many rounds (µs per block, should be flat in N), for unhashed blocks (LIFO reuse) and hashed
  blocks (FIFO, every pop evicts), plus `touch` of blocks in the middle of the free queue.

Configurations: full attention only, and hybrid full + sliding window 128 (two groups).
Results: a rich table on stdout, `<out>/kv_manager.json`, and `<out>/kv_manager.png` when
matplotlib is installed. Every number is measured; nothing is estimated.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from common import (
    RESULTS_DIR,
    command_line,
    make_console,
    pyplot,
    save_figure,
    status_markup,
    table,
    utc_timestamp,
    write_json,
)
from rich.console import Console
from rich.table import Table

from unified_attn.harness.bench import machine_info, percentile, summary
from unified_attn.managers import (
    FullAttentionManager,
    KVCacheManager,
    SchedulerKVCacheConfig,
    SlidingWindowManager,
)
from unified_attn.managers.block_pool import BlockPool
from unified_attn.request import Request

BLOCK_SIZE = 16
VOCAB = 32_000
MAX_MODEL_LEN = 4096
SLIDING_WINDOW = 128
SEED = 1234

# Targets the numbers are compared against.
DECODE_TARGET_US = 1000.0  # hybrid, 256 running requests, per decode step
FLAT_MAX_RATIO = 1.5  # max/min of µs/block over N in {1k, 10k, 100k} counts as "flat"

CONFIGS: dict[str, list[tuple[type, Any]]] = {
    "full": [(FullAttentionManager, FullAttentionManager.Config())],
    "hybrid_full_swa128": [
        (FullAttentionManager, FullAttentionManager.Config()),
        (SlidingWindowManager, SlidingWindowManager.Config(sliding_window=SLIDING_WINDOW)),
    ],
}

FULL_PARAMS: dict[str, Any] = {
    "prefill_requests": 512,
    "prompt_len": 1024,
    "num_prefixes": 4,
    "prefix_len": 512,
    "prefill_repeats": 5,
    "decode_requests": 256,
    "decode_steps": 64,
    "decode_warmup_steps": 8,
    "decode_repeats": 3,
    "churn_admissions": 512,
    "churn_running": 4,
    "churn_pool_requests": 8,
    "churn_repeats": 3,
    "pool_sizes": [1_000, 10_000, 100_000],
    "pool_k": 32,
    "pool_rounds": 4000,
    "pool_batches": 10,
}

QUICK_PARAMS: dict[str, Any] = {
    **FULL_PARAMS,
    "prefill_requests": 32,
    "prefill_repeats": 1,
    "decode_requests": 16,
    "decode_steps": 8,
    "decode_warmup_steps": 2,
    "decode_repeats": 1,
    "churn_admissions": 32,
    "churn_repeats": 1,
    "pool_rounds": 200,
    "pool_batches": 4,
}


# ---- helpers ---------------------------------------------------------------------------------


def make_manager(config_name: str, num_blocks: int) -> KVCacheManager:
    cfg = SchedulerKVCacheConfig(num_blocks, BLOCK_SIZE, CONFIGS[config_name])
    return KVCacheManager(cfg, max_model_len=MAX_MODEL_LEN)


def make_prompts(
    rng: random.Random, n: int, prompt_len: int, num_prefixes: int, prefix_len: int
) -> list[list[int]]:
    """`n` prompts: one of `num_prefixes` shared prefixes (round robin) + a random suffix."""
    prefixes = [rng.choices(range(VOCAB), k=prefix_len) for _ in range(num_prefixes)]
    suffix_len = prompt_len - prefix_len
    return [prefixes[i % num_prefixes] + rng.choices(range(VOCAB), k=suffix_len) for i in range(n)]


def distinct_prompts(rng: random.Random, n: int, prompt_len: int) -> list[list[int]]:
    return [rng.choices(range(VOCAB), k=prompt_len) for _ in range(n)]


def build_requests(
    prompts: Sequence[Sequence[int]], hasher: Callable, tag: str
) -> tuple[list[Request], int]:
    """Build requests with the block hasher; returns them and the elapsed ns."""
    t0 = time.perf_counter_ns()
    reqs = [Request(f"{tag}{i}", p, block_hasher=hasher) for i, p in enumerate(prompts)]
    return reqs, time.perf_counter_ns() - t0


def admit(m: KVCacheManager, r: Request) -> tuple[int, int, Any]:
    """get_computed_blocks + allocate_slots for a whole prompt; returns (lookup ns, alloc ns,
    new blocks). Raises if the pool cannot hold the request (the benchmark sizes it so)."""
    t0 = time.perf_counter_ns()
    blocks, hit = m.get_computed_blocks(r)
    t1 = time.perf_counter_ns()
    new = m.allocate_slots(r, r.num_tokens - hit, hit, blocks)
    t2 = time.perf_counter_ns()
    if new is None:
        raise RuntimeError(f"benchmark pool too small: cannot admit {r.request_id}")
    r.num_computed_tokens += r.num_tokens - hit
    return t1 - t0, t2 - t1, new


def quiesce() -> None:
    gc.collect()


# ---- prefill / admission ---------------------------------------------------------------------


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


# ---- decode ----------------------------------------------------------------------------------


def _prefilled(
    config_name: str, p: dict[str, Any], tag: str
) -> tuple[KVCacheManager, list[Request]]:
    n, plen = p["decode_requests"], p["prompt_len"]
    groups = len(CONFIGS[config_name])
    total_len = plen + p["decode_warmup_steps"] + 2 * p["decode_steps"]
    num_blocks = n * (-(-total_len // BLOCK_SIZE) + 2) * groups + 64
    rng = random.Random(SEED + 1)
    prompts = make_prompts(rng, n, plen, p["num_prefixes"], p["prefix_len"])
    m = make_manager(config_name, num_blocks)
    reqs, _ = build_requests(prompts, m.make_block_hasher(), tag)
    for r in reqs:
        admit(m, r)
    return m, reqs


def decode_step(m: KVCacheManager, reqs: Sequence[Request], token: int) -> None:
    m.new_step_starts()
    for r in reqs:
        r.append_output_token_ids(token)
        if m.allocate_slots(r, 1) is None:
            raise RuntimeError(f"benchmark pool too small: decode of {r.request_id}")
        r.num_computed_tokens += 1


def bench_decode(config_name: str, p: dict[str, Any]) -> dict[str, Any]:
    rng = random.Random(SEED + 2)
    step_us: list[float] = []
    append_us: list[float] = []  # new_step_starts + append_output_token_ids (incl. hashing)
    alloc_us: list[float] = []  # allocate_slots + num_computed_tokens += 1
    for rep in range(p["decode_repeats"]):
        m, reqs = _prefilled(config_name, p, f"d{rep}-")
        for _ in range(p["decode_warmup_steps"]):  # also takes the first step's window trim
            decode_step(m, reqs, rng.randrange(VOCAB))
        quiesce()
        for _ in range(p["decode_steps"]):
            tok = rng.randrange(VOCAB)
            t0 = time.perf_counter_ns()
            decode_step(m, reqs, tok)
            step_us.append((time.perf_counter_ns() - t0) / 1e3)
        usage = m.usage
        # Breakdown pass (same work, phases timed separately): append + hash all, then allocate.
        quiesce()
        for _ in range(p["decode_steps"]):
            tok = rng.randrange(VOCAB)
            t0 = time.perf_counter_ns()
            m.new_step_starts()
            for r in reqs:
                r.append_output_token_ids(tok)
            t1 = time.perf_counter_ns()
            for r in reqs:
                if m.allocate_slots(r, 1) is None:
                    raise RuntimeError(f"benchmark pool too small: decode of {r.request_id}")
                r.num_computed_tokens += 1
            t2 = time.perf_counter_ns()
            append_us.append((t1 - t0) / 1e3)
            alloc_us.append((t2 - t1) / 1e3)
        for r in reqs:
            m.free(r)
    s = summary(step_us)
    n = p["decode_requests"]
    return {
        "step_us": s,
        "us_per_request_median": s["median"] / n,
        "breakdown": {
            "note": "a second pass of the same number of steps, phases timed separately",
            "append_and_hash_us": summary(append_us),
            "allocate_slots_us": summary(alloc_us),
        },
        "num_requests": n,
        "steps": p["decode_steps"],
        "warmup_steps": p["decode_warmup_steps"],
        "repeats": p["decode_repeats"],
        "usage_at_end": usage,
        "step_us_all": step_us,
    }


def profile_decode(config_name: str, p: dict[str, Any], top: int = 15) -> dict[str, Any]:
    """cProfile one decode pass (same workload as `bench_decode`) and list the hot spots."""
    m, reqs = _prefilled(config_name, p, "prof-")
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
    if os.path.abspath(file) == os.path.abspath(__file__):
        return "benchmarks/kv_manager.py"
    marker = "unified_attn" + os.sep
    if marker in file:
        return file[file.rindex(marker) :]
    return os.path.basename(file) if os.sep in file else file


# ---- churn -----------------------------------------------------------------------------------


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


# ---- block pool O(1) -------------------------------------------------------------------------


def _hashed_pool(num_blocks: int, counter: list[int]) -> BlockPool:
    """A pool whose free blocks all carry (fake, unique) hashes: every pop evicts."""
    pool = BlockPool(num_blocks)
    blocks = pool.get_new_blocks(num_blocks - 1)
    _cache(pool, blocks, counter)
    pool.free_blocks(blocks)
    return pool


def _cache(pool: BlockPool, blocks: list, counter: list[int]) -> None:
    start = counter[0]
    counter[0] += len(blocks)
    hashes = [i.to_bytes(32, "little") for i in range(start, start + len(blocks))]
    pool.cache_full_blocks(blocks, hashes, 0, len(blocks), 0)


def bench_pool(num_blocks: int, p: dict[str, Any]) -> dict[str, Any]:
    k, rounds, batches = p["pool_k"], p["pool_rounds"], p["pool_batches"]
    per_batch = max(1, rounds // batches)
    res: dict[str, Any] = {"num_blocks": num_blocks, "k": k, "rounds": per_batch * batches}

    def batch_rates(get_ns: list[int], free_ns: list[int]) -> dict[str, Any]:
        # One µs/block figure per batch of rounds; the median over batches is reported.
        g, f, c = [], [], []
        for b in range(batches):
            sg = sum(get_ns[b * per_batch : (b + 1) * per_batch])
            sf = sum(free_ns[b * per_batch : (b + 1) * per_batch])
            nb = per_batch * k
            g.append(sg / nb / 1e3)
            f.append(sf / nb / 1e3)
            c.append((sg + sf) / nb / 1e3)
        return {
            "get_us_per_block": statistics.median(g),
            "free_us_per_block": statistics.median(f),
            "get_free_us_per_block": statistics.median(c),
            "get_free_us_per_block_batches": c,
        }

    # 1. Unhashed blocks: freed blocks go back to the head and are reused first (LIFO).
    pool = BlockPool(num_blocks)
    for _ in range(50):  # warm-up
        pool.free_blocks(pool.get_new_blocks(k))
    quiesce()
    get_ns, free_ns = [], []
    for _ in range(per_batch * batches):
        t0 = time.perf_counter_ns()
        blocks = pool.get_new_blocks(k)
        t1 = time.perf_counter_ns()
        pool.free_blocks(blocks)
        t2 = time.perf_counter_ns()
        get_ns.append(t1 - t0)
        free_ns.append(t2 - t1)
    res["unhashed"] = batch_rates(get_ns, free_ns)

    # 2. Hashed blocks: freed blocks go to the tail; every pop from the head evicts a hash and
    # the queue cycles through the whole pool.
    counter = [0]
    pool = _hashed_pool(num_blocks, counter)
    for _ in range(50):  # warm-up
        blocks = pool.get_new_blocks(k)
        _cache(pool, blocks, counter)
        pool.free_blocks(blocks)
    quiesce()
    get_ns, free_ns = [], []
    evicted_before = 0
    for _ in range(per_batch * batches):
        head = pool.free_block_queue.head.next_free_block
        evicted_before += head is not None and head.block_hash is not None
        t0 = time.perf_counter_ns()
        blocks = pool.get_new_blocks(k)
        t1 = time.perf_counter_ns()
        _cache(pool, blocks, counter)  # untimed: give the blocks hashes again
        t2 = time.perf_counter_ns()
        pool.free_blocks(blocks)
        t3 = time.perf_counter_ns()
        get_ns.append(t1 - t0)
        free_ns.append(t3 - t2)
    res["hashed_evicting"] = batch_rates(get_ns, free_ns)
    res["hashed_evicting"]["rounds_whose_first_pop_evicted"] = int(evicted_before)

    # 3. touch() of blocks in the middle of the free queue (prefix hits reviving free blocks),
    # then free_blocks() of the same blocks.
    pool = BlockPool(num_blocks)
    lo, hi = num_blocks // 4, 3 * num_blocks // 4
    span = list(range(lo, hi))
    cursor = 0

    def next_batch() -> list:
        nonlocal cursor
        ids = [span[(cursor + i) % len(span)] for i in range(k)]
        cursor = (cursor + k) % len(span)
        return [pool.blocks[i] for i in ids]

    for _ in range(50):  # warm-up
        b = next_batch()
        pool.touch(b)
        pool.free_blocks(b)
    quiesce()
    touch_ns, free_ns = [], []
    positions = []
    for rnd in range(per_batch * batches):
        b = next_batch()
        if rnd % max(1, (per_batch * batches) // 8) == 0:
            positions.append(_queue_position(pool, b[0]) / max(1, pool.get_num_free_blocks()))
        t0 = time.perf_counter_ns()
        pool.touch(b)
        t1 = time.perf_counter_ns()
        pool.free_blocks(b)
        t2 = time.perf_counter_ns()
        touch_ns.append(t1 - t0)
        free_ns.append(t2 - t1)
    rates = batch_rates(touch_ns, free_ns)
    res["touch_middle"] = {
        "touch_us_per_block": rates["get_us_per_block"],
        "free_us_per_block": rates["free_us_per_block"],
        "touch_free_us_per_block": rates["get_free_us_per_block"],
        "sampled_relative_queue_positions": positions,
    }
    return res


def _queue_position(pool: BlockPool, target: Any) -> int:
    """Index of `target` in the free queue (untimed; shows the touched block is mid-queue)."""
    q = pool.free_block_queue
    block, i = q.head.next_free_block, 0
    while block is not None and block is not q.tail:
        if block is target:
            return i
        block, i = block.next_free_block, i + 1
    return -1


# ---- machine, report, plot -------------------------------------------------------------------


def verdicts(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    hybrid = results["decode"].get("hybrid_full_swa128")
    if hybrid is not None:
        med = hybrid["step_us"]["median"]
        out["hybrid_decode_step"] = {
            "target_us": DECODE_TARGET_US,
            "target_num_requests": 256,
            "num_requests": hybrid["num_requests"],
            "measured_median_us": med,
            "measured_p90_us": hybrid["step_us"]["p90"],
            "meets_target": hybrid["num_requests"] >= 256 and med <= DECODE_TARGET_US,
            "comparable": hybrid["num_requests"] == 256,
        }
    flat = {}
    for variant, key in (
        ("unhashed", "get_free_us_per_block"),
        ("hashed_evicting", "get_free_us_per_block"),
        ("touch_middle", "touch_us_per_block"),
    ):
        vals = [r[variant][key] for r in results["block_pool"].values()]
        ratio = max(vals) / min(vals) if min(vals) > 0 else float("inf")
        flat[variant] = {"metric": key, "max_over_min": ratio, "flat": ratio <= FLAT_MAX_RATIO}
    out["block_pool_flat"] = {"threshold_max_over_min": FLAT_MAX_RATIO, **flat}
    return out


def print_report(results: dict[str, Any], console: Console) -> None:
    mi = results["machine"]
    console.print(
        f"[bold]KV-cache manager benchmark[/bold] ({results['mode']}) — {mi['cpu_model']}, "
        f"{mi['cpu_count']} CPUs, Python {mi['python_version']}, torch {mi['torch_version']}"
    )
    console.print(
        f"Targets: hybrid decode step <= {DECODE_TARGET_US:.0f} µs for 256 running requests; "
        f"block µs flat from 1k to 100k blocks (max/min <= {FLAT_MAX_RATIO})."
    )

    t = table(
        "Prefill / admission (1,024-token prompts, 4 shared 512-token prefixes)",
        (
            "config",
            "requests",
            "allocate_slots/s",
            "admissions/s",
            "alloc µs p50",
            "hit rate",
            "hashing tok/s",
        ),
    )
    for name, r in results["prefill"].items():
        t.add_row(
            name,
            str(r["num_requests"]),
            f"{r['allocate_slots_per_s']:,.0f}",
            f"{r['admissions_per_s']:,.0f}",
            f"{r['allocate_slots_us_median']:.1f}",
            f"{r['hit_rate']:.3f}",
            f"{r['hashing_tokens_per_s']:,.0f}",
        )
    console.print(t)

    cols = ("config", "requests", "median", "p90", "mean", "max", "µs/request")
    t = table(
        "Decode (µs per step, all running requests)",
        (*cols, "alloc part p50", "append part p50", "target"),
    )
    for name, r in results["decode"].items():
        s = r["step_us"]
        target = ""
        if name == "hybrid_full_swa128":
            ok = s["median"] <= DECODE_TARGET_US
            target = f"<= {DECODE_TARGET_US:.0f} " + status_markup(ok)
            if r["num_requests"] != 256:
                target += " (n/a: not 256 req)"
        t.add_row(
            name,
            str(r["num_requests"]),
            f"{s['median']:.0f}",
            f"{s['p90']:.0f}",
            f"{s['mean']:.0f}",
            f"{s['max']:.0f}",
            f"{r['us_per_request_median']:.2f}",
            f"{r['breakdown']['allocate_slots_us']['median']:.0f}",
            f"{r['breakdown']['append_and_hash_us']['median']:.0f}",
            target,
        )
    console.print(t)

    t = table(
        "Churn (small pool, distinct prompts: every popped block evicts)",
        (
            "config",
            "pool",
            "allocate_slots/s",
            "admissions/s",
            "alloc µs p50",
            "blocks popped",
            "evictions",
            "evicted frac",
        ),
    )
    for name, r in results["churn"].items():
        t.add_row(
            name,
            str(r["num_blocks"]),
            f"{r['allocate_slots_per_s']:,.0f}",
            f"{r['admissions_per_s']:,.0f}",
            f"{r['allocate_slots_us_median']:.1f}",
            f"{r['blocks_popped']:,}",
            f"{r['evictions']:,}",
            f"{r['eviction_fraction']:.3f}",
        )
    console.print(t)

    t = table(
        "BlockPool: µs per block (median over batches)",
        (
            "N",
            "get (unhashed)",
            "free (unhashed)",
            "get (evicting)",
            "free (hashed)",
            "touch middle",
            "free after touch",
        ),
    )
    for n, r in results["block_pool"].items():
        t.add_row(
            f"{int(n):,}",
            f"{r['unhashed']['get_us_per_block']:.3f}",
            f"{r['unhashed']['free_us_per_block']:.3f}",
            f"{r['hashed_evicting']['get_us_per_block']:.3f}",
            f"{r['hashed_evicting']['free_us_per_block']:.3f}",
            f"{r['touch_middle']['touch_us_per_block']:.3f}",
            f"{r['touch_middle']['free_us_per_block']:.3f}",
        )
    console.print(t)
    flat = results["verdicts"]["block_pool_flat"]
    parts = [
        f"{v}: max/min {flat[v]['max_over_min']:.2f} ({'flat' if flat[v]['flat'] else 'NOT flat'})"
        for v in ("unhashed", "hashed_evicting", "touch_middle")
    ]
    console.print("Flatness 1k→100k: " + "; ".join(parts))

    prof = results.get("decode_profile")
    if prof:
        for key, label in (("by_cumulative", "cumulative"), ("by_tottime", "own time")):
            t = Table(
                title=f"cProfile of decode by {label} ({prof['config']}, "
                f"{prof['num_requests']} requests, {prof['steps']} steps; µs/step under the "
                f"profiler: {prof['profiled_us_per_step']:.0f} total)"
            )
            for col in ("function", "ncalls", "cum µs/step", "tot µs/step"):
                t.add_column(col, justify="right" if col != "function" else "left")
            for row in prof[key]:
                t.add_row(
                    row["function"],
                    str(row["ncalls"]),
                    f"{row['cum_us_per_step']:.0f}",
                    f"{row['tot_us_per_step']:.0f}",
                )
            console.print(t)


def plot(results: dict[str, Any], path: Path, console: Console) -> bool:
    plt = pyplot(console)
    if plt is None:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ns = sorted(results["block_pool"], key=int)
    xs = [int(n) for n in ns]
    series = (
        ("get+free, unhashed", "unhashed", "get_free_us_per_block"),
        ("get+free, evicting", "hashed_evicting", "get_free_us_per_block"),
        ("touch (mid-queue)", "touch_middle", "touch_us_per_block"),
    )
    for label, variant, key in series:
        ax1.plot(xs, [results["block_pool"][n][variant][key] for n in ns], marker="o", label=label)
    ax1.set_xscale("log")
    ax1.set_ylim(bottom=0)
    ax1.set_xlabel("BlockPool size N (blocks)")
    ax1.set_ylabel("µs per block")
    ax1.set_title("BlockPool operations: µs/block vs N")
    ax1.legend()
    ax1.grid(True, alpha=0.3)

    names = list(results["decode"])
    med = [results["decode"][n]["step_us"]["median"] for n in names]
    p90 = [results["decode"][n]["step_us"]["p90"] for n in names]
    pos = range(len(names))
    ax2.bar([x - 0.2 for x in pos], med, width=0.4, label="median")
    ax2.bar([x + 0.2 for x in pos], p90, width=0.4, label="p90")
    ax2.axhline(DECODE_TARGET_US, color="red", linestyle="--", label="target (hybrid)")
    ax2.set_xticks(list(pos))
    ax2.set_xticklabels(names)
    nreq = results["params"]["decode_requests"]
    ax2.set_ylabel(f"µs per decode step ({nreq} requests)")
    ax2.set_title("Decode step time per config")
    ax2.legend()
    ax2.grid(True, axis="y", alpha=0.3)
    fig.suptitle(
        f"unified_attn KV-cache manager — {results['machine']['cpu_model']}, "
        f"Python {results['machine']['python_version']} ({results['mode']})"
    )
    save_figure(fig, path, dpi=120)
    return True


# ---- main ------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="small workloads (smoke test)")
    ap.add_argument("--out", default=RESULTS_DIR, help="output directory")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="always cProfile the hybrid decode (by default only when it misses the target)",
    )
    ap.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    params = dict(QUICK_PARAMS if args.quick else FULL_PARAMS)
    console = make_console(150)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "schema": "unified_attn.benchmarks.kv_manager/v1",
        "mode": "quick" if args.quick else "full",
        "command": command_line("kv_manager.py", argv),
        "machine": machine_info(),
        "timestamp_utc": utc_timestamp(),
        "params": {
            **params,
            "block_size": BLOCK_SIZE,
            "max_model_len": MAX_MODEL_LEN,
            "sliding_window": SLIDING_WINDOW,
            "seed": SEED,
            "timer": "time.perf_counter_ns",
            "gc": "enabled; gc.collect() before each measured section",
        },
        "targets": {
            "hybrid_decode_step_us": DECODE_TARGET_US,
            "hybrid_decode_num_requests": 256,
            "block_pool_flat_max_over_min": FLAT_MAX_RATIO,
        },
    }
    t_start = time.perf_counter()
    with console.status("prefill/admission…"):
        results["prefill"] = {name: bench_prefill(name, params) for name in CONFIGS}
    with console.status("decode…"):
        results["decode"] = {name: bench_decode(name, params) for name in CONFIGS}
    with console.status("churn…"):
        results["churn"] = {name: bench_churn(name, params) for name in CONFIGS}
    with console.status("block pool…"):
        results["block_pool"] = {str(n): bench_pool(n, params) for n in params["pool_sizes"]}
    results["verdicts"] = verdicts(results)
    hybrid = results["verdicts"].get("hybrid_decode_step", {})
    need_profile = args.profile or (
        not args.quick and hybrid and hybrid["measured_median_us"] > DECODE_TARGET_US
    )
    if need_profile:
        with console.status("profiling the hybrid decode…"):
            results["decode_profile"] = profile_decode("hybrid_full_swa128", params)
    results["elapsed_s"] = time.perf_counter() - t_start

    print_report(results, console)
    json_path = out_dir / "kv_manager.json"
    png_path = out_dir / "kv_manager.png"
    results["png"] = None
    if not args.no_plot and plot(results, png_path, console):
        results["png"] = str(png_path)
    write_json(json_path, results)
    console.print(f"Wrote {json_path}" + (f" and {png_path}" if results["png"] else ""))
    return results


if __name__ == "__main__":
    main()
