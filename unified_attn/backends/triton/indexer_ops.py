"""Launcher of DeepSeek-V4's lightning-indexer scores on the paged indexer cache
(`kernels/indexer_scores.py`): the Triton backend's `score_entries`."""

from __future__ import annotations

import torch
import triton

from unified_attn.backends.triton.ops import SUPPORTED_DTYPES
from unified_attn.backends.triton.v4_ops import INDEX_DTYPES, check_row_cache
from unified_attn.kernels.sparse.indexer_scores import indexer_scores_kernel

# Entries and warps per program: the fastest of 32 / 64 / 128 / 256 entries with 2 to 16 warps
# on an H100 at V4's shape (64 heads of 128), decode and prefill alike (benchmarks/README.md).
BLOCK_E = 128
NUM_WARPS = 4


def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    request: torch.Tensor,
    num_visible: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """`out[t, e] = sum_h weights[t, h] * relu(q[t, h] . k[e]) * scale` (float32) for every
    entry e of token t's request that it sees (`e < num_visible[t]`), -inf for the others, where
    `k[e] = cache[blocks[request[t], e], offsets[e]]`: the same result as
    `deepseek_v4_compressed.index_scores`, without gathering `[T, E, D]` keys. q `[T, H, D]`,
    weights `[T, H]` float32, cache `[num_blocks, entries_per_block, D]`, blocks `[B, E]`,
    offsets `[E]`, request and num_visible `[T]`, out `[T, E]` float32; ValueError naming what
    is wrong."""
    _check(q, weights, cache, blocks, offsets, request, num_visible, out)
    num_tokens, num_heads, width = q.shape
    num_entries = out.shape[1]
    if num_tokens == 0 or num_entries == 0:
        return
    q = q if q.stride(2) == 1 else q.contiguous()
    weights, blocks, offsets = weights.contiguous(), blocks.contiguous(), offsets.contiguous()
    grid = (num_tokens, triton.cdiv(num_entries, BLOCK_E))
    indexer_scores_kernel[grid](
        out, q, weights, cache, blocks, offsets, request.contiguous(), num_visible.contiguous(),
        scale, num_heads, num_entries, q.stride(0), q.stride(1), weights.stride(0),
        cache.stride(0), cache.stride(1), blocks.stride(0), out.stride(0),
        H=max(16, triton.next_power_of_2(num_heads)), D=width, BLOCK_E=BLOCK_E,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=NUM_WARPS,
    )  # fmt: skip


def _check(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    request: torch.Tensor,
    num_visible: torch.Tensor,
    out: torch.Tensor,
) -> None:
    num_tokens, num_heads, width = q.shape
    if q.dtype not in SUPPORTED_DTYPES or cache.dtype != q.dtype:
        raise ValueError(
            f"indexer scores: q and cache must share one dtype of {SUPPORTED_DTYPES}, got "
            f"{q.dtype} and {cache.dtype}"
        )
    check_row_cache("indexer scores", cache, width)
    shapes = {
        "weights": (weights, (num_tokens, num_heads), (torch.float32,)),
        "out": (out, (num_tokens, -1), (torch.float32,)),
        "blocks": (blocks, (-1, out.shape[1] if out.dim() == 2 else -1), INDEX_DTYPES),
        "offsets": (offsets, (out.shape[1] if out.dim() == 2 else -1,), INDEX_DTYPES),
        "request": (request, (num_tokens,), (torch.int64,)),
        "num_visible": (num_visible, (num_tokens,), INDEX_DTYPES),
    }
    for name, (tensor, shape, dtypes) in shapes.items():
        found = tuple(tensor.shape)
        fits = len(found) == len(shape) and all(
            e in (-1, f) for e, f in zip(shape, found, strict=True)
        )
        if not fits or tensor.dtype not in dtypes or tensor.device != q.device:
            raise ValueError(
                f"indexer scores: {name} must be {shape} (-1: any) of {dtypes} on {q.device}, "
                f"got {found} {tensor.dtype} on {tensor.device}"
            )
