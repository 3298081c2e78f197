"""Launcher of the gathered shared-KV attention kernel (DeepSeek-V4's window and compressed
caches): `gathered_attention`."""

from __future__ import annotations

import torch
import triton

from unified_attn.backends.triton.kernels.gathered_attention import gathered_attention_kernel
from unified_attn.backends.triton.ops import SUPPORTED_DTYPES

HEADS_PER_PROGRAM = 16  # query heads that share one read of a token's rows
TILE = 32  # rows per loop iteration


def gathered_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Attention of `q [T, H, D]` over the cache rows `cache[blocks[t, s], offsets[t, s]]`
    (`[num_blocks, block_size, D]`; key = value) where `valid [T, S]` (bool): the normalised
    output into `out [T, H, D]` (q's dtype) and the log-sum-exp of the visible scores into
    `lse [T, H]` (float32; -inf and a zero output for a token that sees no row). Same result as
    `deepseek_v4_steps.partial_attention` over the gathered rows."""
    num_tokens, num_heads, width = q.shape
    if q.dtype not in SUPPORTED_DTYPES or cache.dtype != q.dtype or out.dtype != q.dtype:
        raise ValueError(
            f"gathered attention: q, cache and out must share one dtype of {SUPPORTED_DTYPES}, "
            f"got {q.dtype}, {cache.dtype}, {out.dtype}"
        )
    if cache.dim() != 3 or cache.shape[2] != width or cache.stride(2) != 1:
        raise ValueError(
            f"gathered attention: cache must be [num_blocks, block_size, {width}] with "
            f"contiguous features, got {tuple(cache.shape)} strides {cache.stride()}"
        )
    if width < 16 or width & (width - 1):
        raise ValueError(f"gathered attention: head size {width} is not a power of two >= 16")
    lists = (blocks, offsets, valid)
    if any(t.shape != blocks.shape or t.dim() != 2 or t.shape[0] != num_tokens for t in lists):
        raise ValueError(
            f"gathered attention: blocks, offsets and valid must be [{num_tokens}, S], got "
            f"{[tuple(t.shape) for t in lists]}"
        )
    if out.shape != q.shape or lse.shape != (num_tokens, num_heads) or lse.dtype != torch.float32:
        raise ValueError(
            f"gathered attention: out must be {tuple(q.shape)} and lse [{num_tokens}, "
            f"{num_heads}] float32, got {tuple(out.shape)} and {tuple(lse.shape)} {lse.dtype}"
        )
    if num_tokens == 0:
        return
    blocks, offsets = blocks.to(torch.int32).contiguous(), offsets.to(torch.int32).contiguous()
    valid = valid.contiguous().view(torch.uint8)
    q = q if q.stride(-1) == 1 else q.contiguous()
    grid = (num_tokens, triton.cdiv(num_heads, HEADS_PER_PROGRAM))
    gathered_attention_kernel[grid](
        out, lse, q, cache, blocks, offsets, valid, scale, num_heads, blocks.shape[1],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), cache.stride(0), cache.stride(1),
        blocks.stride(0), BH=HEADS_PER_PROGRAM, D=width, TILE=TILE,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4 if width <= 128 else 8, num_stages=2,
    )  # fmt: skip
