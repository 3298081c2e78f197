"""The model configurations (full attention, hybrid full + sliding window), the targets and the
run parameters of the KV-cache manager benchmark (full and quick modes)."""

from __future__ import annotations

from typing import Any

from unified_attn.managers import FullAttentionManager, SlidingWindowManager

BLOCK_SIZE = 16
VOCAB = 32_000
MAX_MODEL_LEN = 4096
SLIDING_WINDOW = 128
SEED = 1234

# Targets the numbers are compared against.
DECODE_TARGET_US = 1000.0  # hybrid, 256 running requests, per decode step
DECODE_TARGET_REQUESTS = 256  # the running requests the decode target is stated for
FLAT_MAX_RATIO = 1.5  # max/min of µs/block over N in {1k, 10k, 100k} counts as "flat"
# The BlockPool variants and the µs/block metric of each that is judged flat (and plotted).
POOL_METRICS = {
    "unhashed": "get_free_us_per_block",
    "hashed_evicting": "get_free_us_per_block",
    "touch_middle": "touch_us_per_block",
}

HYBRID = "hybrid_full_swa128"
CONFIGS: dict[str, list[tuple[type, Any]]] = {
    "full": [(FullAttentionManager, FullAttentionManager.Config())],
    HYBRID: [
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
