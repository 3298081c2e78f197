"""Decode: running requests after their prefill, then decode steps (per step
`new_step_starts()`, and for every request: append one token, `allocate_slots(r, 1)`,
`num_computed_tokens += 1`). Reports µs per step over all requests, and a second pass of the same
length with the append + hash and allocate phases timed separately."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

from common import summary

from unified_attn.managers import KVCacheManager
from unified_attn.request import Request

from .config import BLOCK_SIZE, CONFIGS, SEED, VOCAB
from .workloads import admit, build_requests, make_manager, make_prompts, quiesce


def prefilled(
    config_name: str, p: dict[str, Any], tag: str
) -> tuple[KVCacheManager, list[Request]]:
    """A manager with `decode_requests` requests admitted (prompts as in the prefill section),
    its pool sized for their prompts and every decode step of the section."""
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
        m, reqs = prefilled(config_name, p, f"d{rep}-")
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
