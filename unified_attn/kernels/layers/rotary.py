"""Launcher of the rotary embedding kernel (`rotary_jit.py`): q and k rotated in place from a
`[cos | sin]` table, neox (rotate-half) or interleaved (GPT-J), over the whole head or its first
channels (partial rotary). CUDA, or the CPU under `TRITON_INTERPRET=1` (tests)."""

from __future__ import annotations

import torch
import triton

from unified_attn.kernels.launch import FastLaunch
from unified_attn.kernels.layers.rotary_jit import rotary_kernel as rotary_kernel_jit
from unified_attn.kernels.pdl import pdl_enabled

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
STYLES = ("neox", "interleaved")  # models.config.RopeStyle
TILE = 2048  # (head, channel pair) lanes of one step of a program

# past Triton's Python dispatch (kernels/launch.py)
rotary_kernel = FastLaunch(rotary_kernel_jit)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin: torch.Tensor,
    *,
    positions: torch.Tensor | None = None,
    style: str = "neox",
) -> None:
    """Rotate q `[T, Hq, D]` and k `[T, Hk, D]` (any token and head strides, contiguous
    channels) in place, on their first `R = cos_sin.shape[1]` channels: token t by the row
    `positions[t]` of `cos_sin [rows, R]` (float32: R / 2 cosines, then R / 2 sines), or by
    row t without `positions`. "neox" rounds each product to q's dtype as torch does in it;
    "interleaved" computes in float32 and rounds once."""
    _check(q, k, cos_sin, positions, style)
    tokens, half = q.shape[0], cos_sin.shape[1] // 2
    if tokens == 0 or half == 0:
        return
    block_half = triton.next_power_of_2(half)
    heads = triton.next_power_of_2(max(q.shape[1], k.shape[1]))
    block_h = max(1, min(heads, TILE // block_half))
    rotary_kernel[(tokens,)](
        q, k, cos_sin, cos_sin if positions is None else positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0),
        q.shape[1], k.shape[1], HALF=half, BLOCK_HALF=block_half, BLOCK_H=block_h,
        INTERLEAVED=style == "interleaved", ROUND=style == "neox",
        HAS_POSITIONS=positions is not None, num_warps=4, launch_pdl=pdl_enabled(q.device),
        # no fused multiply-adds: each product is rounded on its own, as in torch (measured on
        # the H200: with them, 1 in 30 bf16 values was one step off torch's)
        enable_fp_fusion=False,
    )  # fmt: skip


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin: torch.Tensor,
    positions: torch.Tensor | None,
    style: str,
) -> None:
    if style not in STYLES:
        raise ValueError(f"apply_rotary: style must be one of {STYLES}, got {style!r}")
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(
            f"apply_rotary: q must be [T, Hq, D] and k [T, Hk, D]; got q {tuple(q.shape)} and "
            f"k {tuple(k.shape)}"
        )
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype:
        raise ValueError(
            f"apply_rotary: q and k must share one dtype of {SUPPORTED_DTYPES}, got {q.dtype} "
            f"and {k.dtype}"
        )
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError(
            f"apply_rotary: q and k rotate in place and need contiguous channels; got strides "
            f"{q.stride()} and {k.stride()}"
        )
    width = cos_sin.shape[-1]
    if cos_sin.dim() != 2 or cos_sin.dtype != torch.float32 or width % 2 or width > q.shape[2]:
        raise ValueError(
            f"apply_rotary: cos_sin must be [rows, R] float32 with R even and at most the head "
            f"size {q.shape[2]}; got {tuple(cos_sin.shape)} {cos_sin.dtype}"
        )
    if cos_sin.stride(1) != 1:
        raise ValueError(f"apply_rotary: cos_sin needs contiguous rows, got {cos_sin.stride()}")
    _check_rows(q, k, cos_sin, positions)


def _check_rows(
    q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor | None
) -> None:
    tokens = q.shape[0]
    if positions is None and cos_sin.shape[0] != tokens:
        raise ValueError(
            f"apply_rotary: without positions cos_sin needs one row per token ({tokens}), got "
            f"{cos_sin.shape[0]}"
        )
    if positions is not None and (positions.shape != (tokens,) or positions.is_floating_point()):
        raise ValueError(
            f"apply_rotary: positions must be [{tokens}] integers, got "
            f"{tuple(positions.shape)} {positions.dtype}"
        )
    devices = {t.device for t in (q, k, cos_sin) + (() if positions is None else (positions,))}
    if len(devices) != 1:
        raise ValueError(f"apply_rotary: q, k, cos_sin and positions on one device, got {devices}")
