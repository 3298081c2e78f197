"""Shapes, targets and constants of the MLA decode benchmark."""

from __future__ import annotations

from typing import Any

SCHEMA = "unified_attn.benchmarks.mla_decode/v1"
TARGET_TB_S = 2.5  # latent bytes, B 64, ctx 8k, H 128 (KERNELS_AND_BENCHMARKS.md)
TOLERANCE = 2e-2  # max |diff| / max |ref|
SEED = 1234

FULL: dict[str, Any] = {
    "heads": [128, 16],
    "batches": [64, 1, 16, 128],  # the target's batch first
    "contexts": [8192, 1024, 32768],
    "kv_lora_rank": 512,
    "rope_dim": 64,
    "page": 64,
    "dtype": "bfloat16",
    "scale": 192**-0.5,
}
QUICK: dict[str, Any] = {
    **FULL,
    "heads": [16],
    "batches": [1, 2],
    "contexts": [64, 160],
    "kv_lora_rank": 64,
    "rope_dim": 16,
    "page": 16,
    "dtype": "float32",
}
