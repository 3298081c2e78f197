"""Prefix hit rate under eviction: LRU against window-aware eviction (CPU, pure Python).

    python benchmarks/eviction.py [--quick] [--out benchmarks/results] [--no-plot] [--seeds 1,2]

A chat workload drives the real `Scheduler` over a `KVCacheManager` (no model: a scripted
sampler returns each request's precomputed output tokens). Conversations start from one of a
few shared system prompts (Zipf popularity), each turn's prompt is the conversation so far plus
a new user message, turns arrive on a fixed schedule, and requests finish and leave cached
blocks behind, so the pool evicts. The workload is identical for both policies (prompts,
outputs and arrival steps are drawn before any step runs).

For each configuration (hybrid full attention + sliding window 128, and full attention alone
as a control) and three pool sizes, the run is repeated with `eviction="lru"` and
`eviction="window_aware"`. Reported: the admission hit rate (prompt tokens found in the prefix
cache when a request is admitted, over the prompt tokens of all admissions), the lookup hit rate
of `prefix_cache_stats` (every `get_computed_blocks`, including retries of a waiting request),
evictions, blocks evicted as dead, preemptions and steps. Writes `<out>/eviction.json` and
`<out>/eviction.png` (when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common import (
    add_out_argument,
    make_console,
    output_dir,
    pyplot,
    run_header,
    save_figure,
    table,
    write_json,
)
from rich.console import Console

from unified_attn.managers import (
    FullAttentionManager,
    KVCacheManager,
    SchedulerKVCacheConfig,
    SlidingWindowManager,
)
from unified_attn.managers.events import BlockRemoved
from unified_attn.managers.eviction import EvictionPolicy
from unified_attn.request import Request
from unified_attn.runner.scheduler import Scheduler
from unified_attn.sampling_params import SamplingParams

BLOCK_SIZE = 16
SLIDING_WINDOW = 128
MAX_MODEL_LEN = 4096
VOCAB = 32_000
POLICIES: tuple[EvictionPolicy, ...] = ("lru", "window_aware")

HYBRID = "hybrid_full_swa128"
CONFIGS: dict[str, list[tuple[type, Any]]] = {
    HYBRID: [
        (FullAttentionManager, FullAttentionManager.Config()),
        (SlidingWindowManager, SlidingWindowManager.Config(sliding_window=SLIDING_WINDOW)),
    ],
    # A wider window keeps more sliding blocks per request, so more of them die.
    "hybrid_full_swa1024": [
        (FullAttentionManager, FullAttentionManager.Config()),
        (SlidingWindowManager, SlidingWindowManager.Config(sliding_window=1024)),
    ],
    "full": [(FullAttentionManager, FullAttentionManager.Config())],  # the control: never dead
}

FULL_PARAMS: dict[str, Any] = {
    "num_system_prompts": 16,
    "system_prompt_len": (256, 1024),
    "zipf_s": 1.1,  # system prompt k is picked with weight 1 / (k + 1) ** zipf_s
    "num_conversations": 240,
    "turns": (1, 4),  # turns per conversation
    "user_len": (32, 256),  # tokens of each user message
    "output_len": (16, 128),  # tokens generated per turn
    "arrival_gap_steps": 2,  # a new conversation every this many steps
    "turn_gap_steps": (40, 160),  # steps between the arrivals of a conversation's turns
    "max_num_seqs": 24,
    "max_num_batched_tokens": 2048,
    "seeds": [1, 2, 3],  # one workload per seed; figures are means over them
    # Pool sizes per configuration, in blocks (the null block included).
    "pool_sizes": {
        HYBRID: [1200, 1800, 2700],
        "hybrid_full_swa1024": [1800, 2700, 4000],
        "full": [800, 1200, 1800],
    },
}

QUICK_PARAMS: dict[str, Any] = {
    **FULL_PARAMS,
    "num_system_prompts": 6,
    "num_conversations": 40,
    "turns": (1, 3),
    "max_num_seqs": 8,
    "seeds": [1],
    "pool_sizes": {
        HYBRID: [400, 600, 900],
        "hybrid_full_swa1024": [600, 900, 1350],
        "full": [260, 400, 600],
    },
}


# ---- the workload ------------------------------------------------------------------------------


def _tokens(rng: random.Random, bounds: tuple[int, int]) -> list[int]:
    return rng.choices(range(VOCAB), k=rng.randint(*bounds))


def make_workload(p: dict[str, Any], seed: int) -> list[dict[str, Any]]:
    """Turns in arrival order: `{"id", "arrival", "prompt", "output"}`, prompts and outputs drawn
    up front (a turn's prompt holds the previous turns' outputs)."""
    rng = random.Random(seed)
    systems = [_tokens(rng, p["system_prompt_len"]) for _ in range(p["num_system_prompts"])]
    weights = [1 / (k + 1) ** p["zipf_s"] for k in range(len(systems))]
    turns = []
    for c in range(p["num_conversations"]):
        history = list(rng.choices(systems, weights)[0])
        arrival = c * p["arrival_gap_steps"]
        for t in range(rng.randint(*p["turns"])):
            prompt = history + _tokens(rng, p["user_len"])
            output = _tokens(rng, p["output_len"])
            if len(prompt) + len(output) > MAX_MODEL_LEN:
                break
            turns.append(
                {"id": f"c{c}t{t}", "arrival": arrival, "prompt": prompt, "output": output}
            )
            history = prompt + output
            arrival += rng.randint(*p["turn_gap_steps"])
    turns.sort(key=lambda turn: (turn["arrival"], turn["id"]))
    return turns


# ---- one run -----------------------------------------------------------------------------------


def simulate(
    config_name: str,
    num_blocks: int,
    eviction: EvictionPolicy,
    workload: Sequence[dict[str, Any]],
    p: dict[str, Any],
) -> dict[str, Any]:
    """Run the workload to the end; the prefix-cache figures of the run."""
    cfg = SchedulerKVCacheConfig(num_blocks, BLOCK_SIZE, CONFIGS[config_name])
    kv = KVCacheManager(cfg, max_model_len=MAX_MODEL_LEN, eviction=eviction)
    sched = Scheduler(
        kv,
        max_num_seqs=p["max_num_seqs"],
        max_num_batched_tokens=p["max_num_batched_tokens"],
        max_model_len=MAX_MODEL_LEN,
    )
    hasher = kv.make_block_hasher()
    outputs = {turn["id"]: turn["output"] for turn in workload}
    pending = list(reversed(workload))
    kv.enable_kv_cache_events()  # BlockRemoved events count the evictions
    evictions = 0
    admitted = hit = steps = 0
    t0 = time.perf_counter()
    while pending or sched.has_unfinished():
        while pending and pending[-1]["arrival"] <= steps:
            turn = pending.pop()
            params = SamplingParams(max_tokens=len(turn["output"]), ignore_eos=True)
            sched.add_request(
                Request(turn["id"], turn["prompt"], block_hasher=hasher, sampling_params=params)
            )
        out = sched.schedule()
        for entry in out.scheduled:
            if entry.is_new and not entry.request.num_preemptions:
                admitted += entry.request.num_tokens
                hit += entry.num_computed_before
        sampled = {
            e.request.request_id: outputs[e.request.request_id][e.request.num_output_tokens]
            for e in out.scheduled
            if e.will_sample
        }
        sched.update_from_output(out, sampled)
        evictions += sum(
            len(e.block_hashes) for e in kv.take_events() if isinstance(e, BlockRemoved)
        )
        steps += 1
    finder = kv.block_pool.dead_blocks
    return {
        "admission_hit_rate": hit / admitted if admitted else 0.0,
        "admitted_tokens": admitted,
        "hit_tokens": hit,
        "lookup_hit_rate": kv.prefix_cache_stats.hit_rate,
        "evictions": evictions,
        "dead_evictions": finder.num_dead_evicted if finder is not None else 0,
        "preemptions": sched.num_preemptions,
        "steps": steps,
        "elapsed_s": time.perf_counter() - t0,
    }


# ---- all runs ----------------------------------------------------------------------------------


def bench_config(config_name: str, p: dict[str, Any], workloads: dict[int, list]) -> dict:
    """Every pool size of one configuration: per-seed runs of both policies and their means."""
    out: dict[str, Any] = {}
    for num_blocks in p["pool_sizes"][config_name]:
        runs = {
            policy: [simulate(config_name, num_blocks, policy, workloads[s], p) for s in p["seeds"]]
            for policy in POLICIES
        }
        row: dict[str, Any] = {"runs": runs}
        for policy, results in runs.items():
            for key in ("admission_hit_rate", "lookup_hit_rate"):
                row[f"{policy}_{key}"] = statistics.fmean(r[key] for r in results)
        diffs = [
            wa["admission_hit_rate"] - lru["admission_hit_rate"]
            for lru, wa in zip(runs["lru"], runs["window_aware"], strict=True)
        ]
        row["hit_rate_gain"] = statistics.fmean(diffs)
        row["hit_rate_gain_min"] = min(diffs)
        row["hit_rate_gain_max"] = max(diffs)
        out[str(num_blocks)] = row
    return out


def header(args: argparse.Namespace, params: dict[str, Any], argv: Sequence[str] | None) -> dict:
    return {
        **run_header("unified_attn.benchmarks.eviction/v1", "eviction.py", args.quick, argv),
        "params": {
            **params,
            "block_size": BLOCK_SIZE,
            "max_model_len": MAX_MODEL_LEN,
            "policies": list(POLICIES),
            "hit_rate": "prompt tokens hit at first admission / prompt tokens of first admissions",
        },
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Prefix hit rate: LRU against window-aware eviction.")
    ap.add_argument("--quick", action="store_true", help="a small workload (smoke test)")
    add_out_argument(ap)
    ap.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    ap.add_argument("--seeds", help="comma-separated workload seeds (default: the mode's)")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    params = dict(QUICK_PARAMS if args.quick else FULL_PARAMS)
    if args.seeds:
        params["seeds"] = [int(seed) for seed in args.seeds.split(",")]
    console = make_console(170)
    out_dir = output_dir(args)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = header(args, params, argv)
    t_start = time.perf_counter()
    workloads = {seed: make_workload(params, seed) for seed in params["seeds"]}
    results["workload"] = {
        str(seed): {"turns": len(w), "prompt_tokens": sum(len(t["prompt"]) for t in w)}
        for seed, w in workloads.items()
    }
    results["configs"] = {}
    for name in CONFIGS:
        with console.status(f"{name}…"):
            results["configs"][name] = bench_config(name, params, workloads)
    results["elapsed_s"] = time.perf_counter() - t_start
    console.print(report_table(results))
    json_path, png_path = out_dir / "eviction.json", out_dir / "eviction.png"
    results["png"] = None
    if not args.no_plot and plot(results, png_path, console):
        results["png"] = str(png_path)
    write_json(json_path, results)
    console.print(f"Wrote {json_path}" + (f" and {png_path}" if results["png"] else ""))
    return results


# ---- report ------------------------------------------------------------------------------------


def report_table(results: dict[str, Any]) -> Any:
    columns = (
        "config", "pool", "LRU", "window-aware", "gain", "gain min..max", "lookups LRU",
        "lookups WA", "evictions WA", "dead", "preempted LRU/WA",
    )  # fmt: skip
    seeds = results["params"]["seeds"]
    title = f"Prefix hit rate at admission, mean over seeds {seeds} ({results['mode']})"
    t = table(title, columns)
    for name, rows in results["configs"].items():
        for pool, row in rows.items():
            lru, wa = row["runs"]["lru"], row["runs"]["window_aware"]
            t.add_row(
                name,
                pool,
                f"{row['lru_admission_hit_rate']:.4f}",
                f"{row['window_aware_admission_hit_rate']:.4f}",
                f"{row['hit_rate_gain']:+.4f}",
                f"{row['hit_rate_gain_min']:+.4f}..{row['hit_rate_gain_max']:+.4f}",
                f"{row['lru_lookup_hit_rate']:.4f}",
                f"{row['window_aware_lookup_hit_rate']:.4f}",
                f"{sum(r['evictions'] for r in wa):,}",
                f"{sum(r['dead_evictions'] for r in wa):,}",
                f"{sum(r['preemptions'] for r in lru)}/{sum(r['preemptions'] for r in wa)}",
            )
    return t


def plot(results: dict[str, Any], path: Path, console: Console) -> bool:
    """One panel per configuration: the hit rate of each policy against the pool size."""
    plt = pyplot(console)
    if plt is None:
        return False
    names = list(results.get("configs", {}))
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        rows = results["configs"][name]
        pools = list(rows)
        pos = range(len(pools))
        for offset, policy in ((-0.2, "lru"), (0.2, "window_aware")):
            rates = [rows[pool][f"{policy}_admission_hit_rate"] for pool in pools]
            ax.bar([x + offset for x in pos], rates, width=0.4, label=policy)
        for x, pool in zip(pos, pools, strict=True):
            gain = 100 * rows[pool]["hit_rate_gain"]
            top = rows[pool]["window_aware_admission_hit_rate"]
            ax.annotate(f"{gain:+.2f} pp", (x + 0.2, top), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(pos))
        ax.set_xticklabels(pools)
        ax.set_xlabel("pool size (blocks)")
        ax.set_ylabel("prefix hit rate (tokens)")
        ax.set_title(name)
        ax.legend()
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"LRU vs window-aware eviction ({results['mode']})")
    save_figure(fig, path, dpi=120)
    return True


if __name__ == "__main__":
    main()
