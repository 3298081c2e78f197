"""Launcher of the gathered shared-KV attention kernel (DeepSeek-V4's window and compressed
caches): `gathered_attention`."""

from __future__ import annotations

import attrs
import torch
import triton

from unified_attn.backends.triton.kernels.gathered_attention import gathered_attention_kernel
from unified_attn.backends.triton.ops import SUPPORTED_DTYPES


@attrs.frozen
class GatherConfig:
    heads: int  # query heads per program: they share one read of the token's rows
    tile: int  # rows per loop iteration
    num_warps: int
    num_stages: int


def gather_config(width: int, num_heads: int) -> GatherConfig:
    """Every head of a token in one program where they fit (up to 64), so its rows are read
    once. Wide rows (V4's 512) take 64-row tiles, 8 warps and 3 stages: the fastest of 54
    configurations on an H100 at the V4 decode shape (`benchmarks/v4_decode.py --sweep`)."""
    heads = min(64, max(16, triton.next_power_of_2(num_heads)))
    if width > 128:
        return GatherConfig(heads, 64, 8, 3)
    return GatherConfig(min(heads, 32), 32, 4, 2)


def gathered_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    config: GatherConfig | None = None,
) -> None:
    """Attention of `q [T, H, D]` over the cache rows `cache[blocks[t, s], offsets[t, s]]`
    (`[num_blocks, block_size, D]`; key = value) where `visible [T, S]` (bool): the normalised
    output into `out [T, H, D]` (q's dtype) and the log-sum-exp of the visible scores into
    `lse [T, H]` (float32; -inf and a zero output for a token that sees no row). Same result as
    `deepseek_v4_steps.partial_attention` over the gathered rows. `config` overrides
    `gather_config` (benchmarks/v4_decode.py --sweep)."""
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
    lists = (blocks, offsets, visible)
    if any(t.shape != blocks.shape or t.dim() != 2 or t.shape[0] != num_tokens for t in lists):
        raise ValueError(
            f"gathered attention: blocks, offsets and visible must be [{num_tokens}, S], got "
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
    valid = visible.contiguous().view(torch.uint8)
    q = q if q.stride(-1) == 1 else q.contiguous()
    cfg = config or gather_config(width, num_heads)
    grid = (num_tokens, triton.cdiv(num_heads, cfg.heads))
    gathered_attention_kernel[grid](
        out, lse, q, cache, blocks, offsets, valid, scale, num_heads, blocks.shape[1],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), cache.stride(0), cache.stride(1),
        blocks.stride(0), BH=cfg.heads, D=width, TILE=cfg.tile,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
