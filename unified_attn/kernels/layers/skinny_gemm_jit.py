"""A GEMM for decode rows (launcher: `skinny_gemm.py`): `y = prologue(x) @ W^T (+ bias)` for a
few rows (M <= BLOCK_M = 16) against a weight `W [N, K]` read once, each program owning BLOCK_N
output columns over the whole of K (no split-K, no reduction kernel).

The prologue fuses the kernel that would run before the GEMM, so its input never goes through
memory: PROLOGUE 0 takes x as it is; 1 the residual add and RMSNorm of a decoder layer (`h = x +
residual`, rounded to x's dtype as torch adds, then `norm_jit._scale` of h with the norm weight,
rounded to x's dtype: the values `add_rms_norm` would store), program 0 storing h as the new
residual; 2 the gated activation of a `[M, 2K]` gate/up output (`activation_jit._activate` of the
gate, rounded, times up, rounded: `act_and_mul`'s values). The GEMM's inputs are therefore
bitwise those of the unfused kernels; only the accumulation order is the kernel's own. The
norm's sum of squares takes a first pass over x (M x K values, from L2).
"""

from __future__ import annotations

import triton
import triton.language as tl

from unified_attn.kernels.layers.activation_jit import _activate
from unified_attn.kernels.layers.norm_jit import _scale


@triton.jit
def _rows_in(x_ptr, r_ptr, rm, k, stride_xm, stride_rm, row_ok, HAS_RESIDUAL: tl.constexpr):
    """x's `[BLOCK_M, BLOCK_K]` chunk at columns k, plus the residual's (rounded to x's dtype)."""
    mask = row_ok[:, None] & (k[None, :] >= 0)
    x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + rm[:, None] * stride_rm + k[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def skinny_gemm_kernel(
    x_ptr,  # [M, K] (PROLOGUE 2: [M, 2K], the gate columns, then up)
    w_ptr,  # [N, K], rows contiguous
    bias_ptr,  # [N] or unused
    y_ptr,  # [M, N]
    r_ptr,  # PROLOGUE 1 with HAS_RESIDUAL: the residual [M, K]
    r_out_ptr,  # PROLOGUE 1: the new residual [M, K] (program 0 writes it)
    norm_w_ptr,  # PROLOGUE 1: the norm weight [K]
    M,
    N,
    K,
    eps,
    stride_xm,
    stride_wn,
    stride_ym,
    stride_rm,
    PROLOGUE: tl.constexpr,  # 0 none, 1 residual add + RMSNorm, 2 gated activation
    HAS_RESIDUAL: tl.constexpr,
    STYLE: tl.constexpr,  # the norm's style (norm_jit._scale)
    ACT: tl.constexpr,  # the activation (activation_jit._activate)
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT: tl.constexpr,  # tl.dot input precision: "ieee" for float32 inputs
):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    row_ok = rm < M
    col_ok = rn < N
    dt = x_ptr.dtype.element_ty
    inv = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PROLOGUE == 1:  # the sum of squares of h = x + residual; program 0 stores h
        squares = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k = tl.where(k < K, k, -1)
            h = _rows_in(x_ptr, r_ptr, rm, k, stride_xm, stride_rm, row_ok, HAS_RESIDUAL)
            hf = h.to(tl.float32)
            squares += tl.sum(hf * hf, axis=1)
            if HAS_RESIDUAL:
                tl.store(r_out_ptr + rm[:, None] * stride_rm + k[None, :], h,
                         mask=row_ok[:, None] & (k[None, :] >= 0) & (pid == 0))  # fmt: skip
        inv = tl.rsqrt(squares / K + eps)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + k[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        if PROLOGUE == 1:
            h = _rows_in(x_ptr, r_ptr, rm, tl.where(k_ok, k, -1), stride_xm, stride_rm, row_ok,
                         HAS_RESIDUAL)  # fmt: skip
            g = tl.load(norm_w_ptr + k, mask=k_ok, other=0.0)
            a = _scale(h, inv[:, None], g[None, :], STYLE).to(dt)
        elif PROLOGUE == 2:
            mask = row_ok[:, None] & k_ok[None, :]
            rows = x_ptr + rm[:, None] * stride_xm
            gate = tl.load(rows + k[None, :], mask=mask, other=0.0)
            up = tl.load(rows + K + k[None, :], mask=mask, other=0.0)
            act = _activate(gate.to(tl.float32), ACT).to(dt)
            a = (act.to(tl.float32) * up.to(tl.float32)).to(dt)
        else:
            a = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(a, tl.trans(w.to(dt)), acc, input_precision=DOT)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip
