"""The migration workload: `Workload` (its prompts), `SMALL_WORKLOAD`, the engine settings that
make it chunk prefills, and the KV-cache budget that forces preemption (`pressured_budget`, from
a run with ample memory)."""

from __future__ import annotations

import random
from typing import Any

import attrs

from unified_attn.engine.llm_engine import LLMEngine


@attrs.frozen
class Workload:
    num_requests: int = 8
    num_prefixes: int = 2
    prefix_len: int = 40
    tail_len: tuple[int, int] = (4, 24)
    max_tokens: int = 8
    max_num_batched_tokens: int = 32  # < prompt length: every prefill is chunked
    max_model_len: int = 256  # at most; the engines take the longest request's length
    seed: int = 0

    def prompts(self, vocab_size: int) -> list[list[int]]:
        rng = random.Random(self.seed)
        vocab = min(vocab_size, 256)
        prefixes = [
            [rng.randrange(vocab) for _ in range(self.prefix_len)] for _ in range(self.num_prefixes)
        ]
        return [
            prefixes[i % self.num_prefixes]
            + [rng.randrange(vocab) for _ in range(rng.randint(*self.tail_len))]
            for i in range(self.num_requests)
        ]


# Three requests, still with chunked prefills, a prefix hit, mixed steps and a preemption.
SMALL_WORKLOAD = Workload(
    num_requests=3,
    prefix_len=20,
    tail_len=(8, 11),
    max_tokens=4,
    max_num_batched_tokens=16,
    max_model_len=64,
)


def engine_kwargs(
    workload: Workload, prompts: list[list[int]], device: str, dtype: str, seed: int
) -> dict[str, Any]:
    """The engines' settings: `max_model_len` just fits the longest request (so one request's
    blocks are few and the budget can be tight), a cache ample for the whole workload."""
    longest = max(len(p) for p in prompts) + workload.max_tokens
    return {
        "device": device,
        "dtype": dtype,
        "seed": seed,
        "max_model_len": min(workload.max_model_len, longest),
        "max_num_batched_tokens": workload.max_num_batched_tokens,
        "kv_cache_memory": AMPLE,
        "cuda_graphs": False,  # compare the backends, not the graph runtime
    }


AMPLE = "256MiB"  # the probe's cache: room for every request of a workload at once


def pressured_budget(engine: LLMEngine, peak_blocks: int) -> tuple[int, str | None]:
    """Bytes for four fifths of the blocks the workload held at its peak with ample memory (at
    least one longest request and one more block), so running requests outgrow the cache and
    the scheduler preempts; and, when that peak is no more than one request's worth, what to
    say if no preemption happens (the workload cannot be pressured)."""
    worker = engine.worker
    one_request = sum(worker.blocks_per_request) + 1
    blocks = max(one_request, peak_blocks * 4 // 5)
    note = None
    if peak_blocks <= one_request:
        note = (
            f"the workload cannot preempt: at its peak it holds {peak_blocks} blocks, one "
            "request's worth; give it more requests to exercise preemption"
        )
    return worker.plan.bytes_per_block * blocks, note
