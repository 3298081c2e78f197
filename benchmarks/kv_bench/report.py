"""The text report on stdout: the machine and the targets, one table per section (prefill,
decode, churn, block pool), the flatness verdicts and, when the decode was profiled, its hot
spots."""

from __future__ import annotations

from typing import Any

from common import status_markup, table
from rich.console import Console
from rich.table import Table

from .config import DECODE_TARGET_REQUESTS, DECODE_TARGET_US, FLAT_MAX_RATIO, HYBRID, POOL_METRICS

PREFILL_COLUMNS = (
    "config", "requests", "allocate_slots/s", "admissions/s", "alloc µs p50", "hit rate",
    "hashing tok/s",
)  # fmt: skip
DECODE_COLUMNS = (
    "config", "requests", "median", "p90", "mean", "max", "µs/request", "alloc part p50",
    "append part p50", "target",
)  # fmt: skip
CHURN_COLUMNS = (
    "config", "pool", "allocate_slots/s", "admissions/s", "alloc µs p50", "blocks popped",
    "evictions", "evicted frac",
)  # fmt: skip
LOOKUP_COLUMNS = (
    "config", "prompt", "case", "hit", "mean µs", "median µs", "min µs", "÷ full", "per group",
)  # fmt: skip
POOL_COLUMNS = (
    "N", "get (unhashed)", "free (unhashed)", "get (evicting)", "free (hashed)", "touch middle",
    "free after touch",
)  # fmt: skip


def print_report(results: dict[str, Any], console: Console) -> None:
    mi = results["machine"]
    console.print(
        f"[bold]KV-cache manager benchmark[/bold] ({results['mode']}) — {mi['cpu_model']}, "
        f"{mi['cpu_count']} CPUs, Python {mi['python_version']}, torch {mi['torch_version']}"
    )
    console.print(
        f"Targets: hybrid decode step <= {DECODE_TARGET_US:.0f} µs for "
        f"{DECODE_TARGET_REQUESTS} running requests; "
        f"block µs flat from 1k to 100k blocks (max/min <= {FLAT_MAX_RATIO})."
    )
    console.print(prefill_table(results["prefill"]))
    console.print(decode_table(results["decode"]))
    console.print(churn_table(results["churn"]))
    console.print(pool_table(results["block_pool"]))
    flat = results["verdicts"]["block_pool_flat"]
    parts = [
        f"{v}: max/min {flat[v]['max_over_min']:.2f} ({'flat' if flat[v]['flat'] else 'NOT flat'})"
        for v in POOL_METRICS
    ]
    console.print("Flatness 1k→100k: " + "; ".join(parts))
    prof = results.get("decode_profile")
    if prof:
        for key, label in (("by_cumulative", "cumulative"), ("by_tottime", "own time")):
            console.print(profile_table(prof, key, label))


def prefill_table(prefill: dict[str, Any]) -> Table:
    t = table(
        "Prefill / admission (1,024-token prompts, 4 shared 512-token prefixes)", PREFILL_COLUMNS
    )
    for name, r in prefill.items():
        t.add_row(
            name,
            str(r["num_requests"]),
            f"{r['allocate_slots_per_s']:,.0f}",
            f"{r['admissions_per_s']:,.0f}",
            f"{r['allocate_slots_us_median']:.1f}",
            f"{r['hit_rate']:.3f}",
            f"{r['hashing_tokens_per_s']:,.0f}",
        )
    return t


def decode_table(decode: dict[str, Any]) -> Table:
    t = table("Decode (µs per step, all running requests)", DECODE_COLUMNS)
    for name, r in decode.items():
        s = r["step_us"]
        target = ""
        if name == HYBRID:
            ok = s["median"] <= DECODE_TARGET_US
            target = f"<= {DECODE_TARGET_US:.0f} " + status_markup(ok)
            if r["num_requests"] != DECODE_TARGET_REQUESTS:
                target += f" (n/a: not {DECODE_TARGET_REQUESTS} req)"
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
    return t


def churn_table(churn: dict[str, Any]) -> Table:
    t = table("Churn (small pool, distinct prompts: every popped block evicts)", CHURN_COLUMNS)
    for name, r in churn.items():
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
    return t


def pool_table(block_pool: dict[str, Any]) -> Table:
    t = table("BlockPool: µs per block (median over batches)", POOL_COLUMNS)
    for n, r in block_pool.items():
        t.add_row(
            f"{int(n):,}",
            f"{r['unhashed']['get_us_per_block']:.3f}",
            f"{r['unhashed']['free_us_per_block']:.3f}",
            f"{r['hashed_evicting']['get_us_per_block']:.3f}",
            f"{r['hashed_evicting']['free_us_per_block']:.3f}",
            f"{r['touch_middle']['touch_us_per_block']:.3f}",
            f"{r['touch_middle']['free_us_per_block']:.3f}",
        )
    return t


def profile_table(prof: dict[str, Any], key: str, label: str) -> Table:
    """The decode's hot spots sorted by `key` (`by_cumulative` or `by_tottime`)."""
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
    return t


def lookup_table(lookup: dict[str, Any]) -> Table:
    t = table(
        f"get_computed_blocks, µs per call ({lookup['rounds']:,} interleaved rounds; "
        "÷ full: median over full attention's at the same prompt and case)",
        LOOKUP_COLUMNS,
    )
    ratios = {(r["config"], r["prompt_len"], r["case"]): r for r in lookup["ratios"]}
    for r in lookup["rows"]:
        ratio = ratios.get((r["config"], r["prompt_len"], r["case"]))
        t.add_row(
            r["config"],
            f"{r['prompt_len']:,}",
            r["case"],
            f"{r['hit_tokens']:,}",
            f"{r['mean_us']:.1f}",
            f"{r['median_us']:.1f}",
            f"{r['min_us']:.1f}",
            f"{ratio['hybrid_over_full']:.2f}" if ratio else "",
            f"{ratio['per_group']:.2f}" if ratio else "",
        )
    return t
