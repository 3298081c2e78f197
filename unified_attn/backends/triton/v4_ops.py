"""Launcher of the gathered shared-KV attention kernel (DeepSeek-V4's window and compressed
caches): `gathered_attention`."""

from __future__ import annotations

import attrs
import torch
import triton

from unified_attn.backends.triton.kernels.gathered_attention import gathered_attention_kernel
from unified_attn.backends.triton.ops import SUPPORTED_DTYPES

INDEX_DTYPES = (torch.int32, torch.int64)


@attrs.frozen
class GatherConfig:
    heads: int  # query heads per program; the programs of one token share its rows through L2
    tile: int  # rows per loop iteration
    num_warps: int
    num_stages: int
    index_ahead: bool = True  # load the next tile's list entries while this tile is used
    max_registers: int | None = None  # per thread (Triton's `maxnreg`): more programs per SM


def gather_config(width: int, num_heads: int) -> GatherConfig:
    """Wide rows (V4's 512) take 32 heads per program, 64-row tiles, 8 warps and 3 stages: the
    fastest of the configurations `benchmarks/v4_decode.py --sweep` times on an H100 at the V4
    decode shape (64 heads: two programs per token share its rows through L2; 64 heads per
    program hold the whole query and accumulator in registers, one program per token). Narrow
    rows keep every head (up to 32) in one program with 32-row tiles."""
    heads = min(32, max(16, triton.next_power_of_2(num_heads)))
    if width > 128:
        return GatherConfig(heads, 64, 8, 3)
    return GatherConfig(heads, 32, 4, 2)


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
    kinds = (blocks.dtype, offsets.dtype, visible.dtype)
    if kinds[0] not in INDEX_DTYPES or kinds[1] != kinds[0] or kinds[2] != torch.bool:
        raise ValueError(
            f"gathered attention: blocks and offsets must share one dtype of {INDEX_DTYPES} and "
            f"visible must be torch.bool, got {kinds}"
        )
    if out.shape != q.shape or lse.shape != (num_tokens, num_heads) or lse.dtype != torch.float32:
        raise ValueError(
            f"gathered attention: out must be {tuple(q.shape)} and lse [{num_tokens}, "
            f"{num_heads}] float32, got {tuple(out.shape)} and {tuple(lse.shape)} {lse.dtype}"
        )
    if num_tokens == 0:
        return
    blocks, offsets = blocks.contiguous(), offsets.contiguous()  # no copy when they are
    valid = visible.contiguous().view(torch.uint8)
    q = q if q.stride(-1) == 1 else q.contiguous()
    cfg = config or gather_config(width, num_heads)
    grid = (triton.cdiv(num_heads, cfg.heads), num_tokens)  # a token's head groups adjacent
    gathered_attention_kernel[grid](
        out, lse, q, cache, blocks, offsets, valid, scale, num_heads, blocks.shape[1],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), cache.stride(0), cache.stride(1),
        blocks.stride(0), BH=cfg.heads, D=width, TILE=cfg.tile,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        INDEX_AHEAD=cfg.index_ahead,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.max_registers,
    )  # fmt: skip
