"""The migration workload: `Workload` (its prompts), `SMALL_WORKLOAD`, and the engine settings
and KV-cache budget that make it chunk prefills and force preemption."""

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
    max_model_len: int = 256
    spare_blocks: int = 4  # KV budget: one max_model_len request plus this many blocks
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
    spare_blocks=0,
)


def engine_kwargs(workload: Workload, device: str, dtype: str, seed: int) -> dict[str, Any]:
    return {
        "device": device,
        "dtype": dtype,
        "seed": seed,
        "max_model_len": workload.max_model_len,
        "max_num_batched_tokens": workload.max_num_batched_tokens,
        "cuda_graphs": False,  # compare the backends, not the graph runtime
    }


def kv_budget(engine: LLMEngine, spare_blocks: int) -> int:
    """Bytes for one `max_model_len` request plus `spare_blocks`: concurrency forces preemption."""
    worker = engine.worker
    return worker.plan.bytes_per_block * (sum(worker.blocks_per_request) + 1 + spare_blocks)
