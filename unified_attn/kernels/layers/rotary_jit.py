"""Rotary embedding kernel (launcher: `rotary.py`): q and k rotated in place, the first `2 * HALF`
channels of every head, from a table of `[cos | sin]` rows (float32, `HALF` each).

Neox style (rotate-half) pairs channel `i` with `i + HALF` and, with `ROUND`, rounds as
`models.rope.RotaryEmbedding` does in torch: cos and sin rounded to x's dtype, each product
rounded, then the sum. Interleaved (GPT-J) style pairs channels `2i` and `2i + 1`, computed in
float32 and rounded once (transformers' complex form, Llama 4).
"""

from __future__ import annotations

import triton
import triton.language as tl

from unified_attn.kernels.pdl_jit import pdl_start


@triton.jit
def _rotate(x1, x2, c, s, ROUND: tl.constexpr):
    """`(x1 * c - x2 * s, x2 * c + x1 * s)` in x's dtype."""
    dt = x1.dtype
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    if ROUND:
        c = c.to(dt).to(tl.float32)
        s = s.to(dt).to(tl.float32)
        o1 = (x1f * c).to(dt).to(tl.float32) - (x2f * s).to(dt).to(tl.float32)
        o2 = (x2f * c).to(dt).to(tl.float32) + (x1f * s).to(dt).to(tl.float32)
    else:
        o1 = x1f * c - x2f * s
        o2 = x2f * c + x1f * s
    return o1.to(dt), o2.to(dt)


@triton.jit
def _rotate_heads(
    x_ptr, stride_h, num_heads, c, s, first, second, lane_ok,
    ROUND: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Every head of one token, BLOCK_H heads at a time: channels `first` pair with `second`."""
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads < num_heads)[:, None] & lane_ok[None, :]
        base = x_ptr + heads.to(tl.int64)[:, None] * stride_h
        x1 = tl.load(base + first[None, :], mask=mask, other=0.0)
        x2 = tl.load(base + second[None, :], mask=mask, other=0.0)
        o1, o2 = _rotate(x1, x2, c[None, :], s[None, :], ROUND)
        tl.store(base + first[None, :], o1, mask=mask)
        tl.store(base + second[None, :], o2, mask=mask)


@triton.jit
def rotary_kernel(
    q_ptr,  # [T, Hq, D], last dim contiguous
    k_ptr,  # [T, Hk, D], last dim contiguous
    cos_sin_ptr,  # [rows, 2 * HALF] float32: cos, then sin
    positions_ptr,  # [T] the table row of each token (HAS_POSITIONS; else row t)
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    ROUND: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
    launch_pdl: tl.constexpr = False,  # kernels/pdl.py
):
    pdl_start(launch_pdl)
    token = tl.program_id(0).to(tl.int64)
    row = token
    if HAS_POSITIONS:
        row = tl.load(positions_ptr + token).to(tl.int64)
    lanes = tl.arange(0, BLOCK_HALF)
    lane_ok = lanes < HALF
    c = tl.load(cos_sin_ptr + row * stride_cs + lanes, mask=lane_ok, other=0.0)
    s = tl.load(cos_sin_ptr + row * stride_cs + HALF + lanes, mask=lane_ok, other=0.0)
    if INTERLEAVED:
        first = 2 * lanes
        second = 2 * lanes + 1
    else:
        first = lanes
        second = HALF + lanes
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, num_q_heads, c, s, first, second,
                  lane_ok, ROUND, BLOCK_H)  # fmt: skip
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, num_k_heads, c, s, first, second,
                  lane_ok, ROUND, BLOCK_H)  # fmt: skip
