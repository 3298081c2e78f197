"""The building blocks the sections share: a manager for a configuration, the prompts (shared
prefixes or distinct), `Request` objects built with the block hasher (timed), the admission of one
request (timed lookup and allocation) and the `gc.collect()` before each measured section."""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from unified_attn.managers import KVCacheManager, SchedulerKVCacheConfig
from unified_attn.request import Request

from .config import BLOCK_SIZE, CONFIGS, MAX_MODEL_LEN, VOCAB


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
