"""Shapes, tolerances, time budgets, targets and the run parameters of the attention benchmark
(full and quick modes). The head counts, head size and page size come from `common`."""

from __future__ import annotations

from typing import Any

import torch
from common import HEAD, HKV, HQ

QPK = HQ // HKV
DTYPE = torch.bfloat16
ELT = 2  # bytes per bf16 element
SCALE = HEAD**-0.5
KV_BYTES_PER_TOKEN = 2 * HKV * HEAD * ELT  # K and V
GIB = 1 << 30
ROTATE_BELOW = 200e6  # bytes: smaller working sets rotate buffers (L2 is 50 MB)
ROTATE_TARGET = 256 << 20  # bytes covered by one rotation
MAX_ROTATE = 64
MAX_KV_BYTES = 40 * GIB
TOLERANCE = 2e-2  # max |diff| / max |ref|, bf16
SEED = 1234
SOFT_CAP = 30.0
WINDOW = 1024
SECTIONS = ("decode", "prefill", "window", "features", "split")
FLEX_COMPILE_COST_S = 25.0  # what a FlexAttention compile is assumed to cost (budget guard)

TARGETS = {
    "decode_large_tb_s": 3.0,  # KV >= 4 GiB
    "decode_large_min_kv_gib": 4.0,
    "decode_mid_tb_s": 2.7,  # B 16-32, ctx 8k
    "decode_b1_32k_tb_s": 1.5,
    "decode_vs_flex_paged": 1.5,  # time ratio, large work
    "prefill_vs_sdpa_flash": 1.2,
    "prefill_vs_sdpa_cudnn_stretch": 0.9,
    "window_pct_of_ideal": 50.0,
    "feature_overhead_pct": 3.0,
}

_DECODE_GRID = [
    (b, c) for b in (1, 4, 16, 32, 64, 128, 256) for c in (1024, 4096, 8192, 16384, 32768)
]
# Shapes the targets name (and the FlexAttention ones) run first, so that a budget overrun skips
# the least important ones.
_DECODE_FIRST = [(1, 32768), (16, 8192), (32, 8192), (128, 8192), (256, 4096), (64, 16384)]

FULL_PARAMS: dict[str, Any] = {
    "decode_shapes": _DECODE_FIRST + [s for s in _DECODE_GRID if s not in _DECODE_FIRST],
    "flex_decode_shapes": [(1, 32768), (16, 8192), (32, 8192), (128, 8192), (256, 4096)],
    "prefill_shapes": [(b, n) for b in (1, 4) for n in (2048, 4096, 8192, 16384, 32768)],
    "flex_prefill_shapes": [(b, n) for b in (1, 4) for n in (2048, 4096, 8192, 16384, 32768)],
    "window_len": 32768,
    "features_decode": (32, 8192),
    "features_prefill_len": 8192,
    "split_ctx": 32768,
    "flex_window": True,
    "flex_dense_decode": True,
    "budget_s": 450.0,
    # Seconds kept for each later section when an earlier one decides what it can still afford
    # (their minimum without FlexAttention compiles).
    "reserve_s": {"decode": 0.0, "prefill": 30.0, "window": 10.0, "features": 15.0, "split": 4.0},
}
QUICK_PARAMS: dict[str, Any] = {
    "decode_shapes": [(1, 32768), (32, 8192), (128, 8192)],
    "flex_decode_shapes": [(128, 8192)],
    "prefill_shapes": [(1, 16384), (1, 4096), (4, 4096)],
    "flex_prefill_shapes": [(1, 16384)],
    "window_len": 32768,
    "features_decode": (32, 8192),
    "features_prefill_len": 8192,
    "split_ctx": 32768,
    "flex_window": False,
    "flex_dense_decode": False,
    "budget_s": 105.0,
    "reserve_s": {"decode": 0.0, "prefill": 10.0, "window": 6.0, "features": 10.0, "split": 3.0},
}
