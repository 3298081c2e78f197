"""BlockPool O(1): `BlockPool(N)` for several N, many rounds of `get_new_blocks(k)` /
`free_blocks`, in µs per block (the median over batches of rounds; flat in N when O(1)). Three
variants: unhashed blocks (LIFO reuse), hashed blocks (FIFO, every pop evicts) and `touch()` of
blocks in the middle of the free queue."""

from __future__ import annotations

import statistics
import time
from typing import Any

from unified_attn.managers.block_pool import BlockPool

from .workloads import quiesce


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
