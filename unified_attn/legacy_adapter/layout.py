"""The legacy cache layout as a view of the unified page, without copying.

The worker binds `[num_blocks, 2, block_size, Hkv, D]` views (`PagedKVSpec`). Legacy backends
declare their layout through `get_kv_cache_shape`; the two that are permutations of the unified
view are served: blocks first (the unified view itself) and K/V first
(`[2, num_blocks, block_size, Hkv, D]`, vLLM's old FlashAttention layout) as `view.transpose(0, 1)`.
"""

from __future__ import annotations

import torch

from unified_attn.legacy_adapter.interfaces import LegacyAttentionBackend

# A block count no other dimension will equal: where it lands in the declared shape tells the
# layout apart even when the real block count is 2 (then both layouts have the same shape).
_PROBE_BLOCKS = 7919


def to_legacy_layout(legacy: type[LegacyAttentionBackend], view: torch.Tensor) -> torch.Tensor:
    """`view [num_blocks, 2, block_size, Hkv, D]` in the layout `legacy` declares."""
    num_blocks, _, block_size, num_kv_heads, head_size = view.shape
    probe = tuple(legacy.get_kv_cache_shape(_PROBE_BLOCKS, block_size, num_kv_heads, head_size))
    declared = tuple(legacy.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size))
    candidates: dict[tuple[int, ...], torch.Tensor] = {
        (_PROBE_BLOCKS, 2, block_size, num_kv_heads, head_size): view,
        (2, _PROBE_BLOCKS, block_size, num_kv_heads, head_size): view.transpose(0, 1),
    }
    legacy_view = candidates.get(probe)
    if legacy_view is None or tuple(legacy_view.shape) != declared:
        raise ValueError(
            f"legacy backend {legacy.get_name()} declares KV-cache shape {declared}; the adapter "
            f"serves views of the unified page only: [num_blocks, 2, block_size, num_kv_heads, "
            f"head_size] = {tuple(view.shape)} or its K/V-first transpose "
            f"{tuple(view.transpose(0, 1).shape)}. Change get_kv_cache_shape to one of them."
        )
    return legacy_view
