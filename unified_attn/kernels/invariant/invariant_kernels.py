"""Triton kernels of the batch-invariant ops (launchers: `invariant_launch.py`).

Every kernel computes an output element with the same sequence of operations whatever the
number of rows: matmul tiles and reduction blocks are chosen from the reduced length (and the
output width) only, the K loop never splits, and a row's reduction never meets another row.
`M` (the number of rows) is never specialised, so one compiled kernel serves every batch.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def matmul_kernel(
    a_ptr,  # [M, K]
    b_ptr,  # [K, N], any strides (a linear layer's weight [N, K] is read transposed)
    c_ptr,  # [M, N]
    bias_ptr,  # [N] (HAS_BIAS)
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K mask
):
    """C = A @ B (+ bias) with float32 accumulation. One program owns a BLOCK_M x BLOCK_N tile
    and walks K from 0 in steps of BLOCK_K: an element's reduction order depends on K alone."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # GROUP_M row tiles in a row share each weight tile while it is in L2 (order only).
    per_group = GROUP_M * num_n
    first_m = pid // per_group * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + ks[:, None] * stride_bk + cols.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks < K - step * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _row_sum_of_squares(x_ptr, N, SUBTRACT: tl.constexpr, mean, BLOCK: tl.constexpr):
    """Sum over one row of (x - mean)^2 (SUBTRACT) or x^2, in float32: BLOCK lanes accumulate
    the row's chunks in order, then one tree sums the lanes (fixed by N and BLOCK)."""
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, N, BLOCK):
        ok = start + cols < N
        x = tl.load(x_ptr + start + cols, mask=ok, other=0.0).to(tl.float32)
        if SUBTRACT:
            x = tl.where(ok, x - mean, 0.0)
        acc += x * x
    return tl.sum(acc, axis=0)


@triton.jit
def _row_sum(x_ptr, N, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, N, BLOCK):
        acc += tl.load(x_ptr + start + cols, mask=start + cols < N, other=0.0).to(tl.float32)
    return tl.sum(acc, axis=0)


@triton.jit
def rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_out,
    N,
    eps,
    STYLE: tl.constexpr,  # 0: llama, 1: float32, 2: gemma (layers.RMSNorm's styles)
    BLOCK: tl.constexpr,
):
    """One program per row: `x / sqrt(mean(x^2) + eps)` in float32, then the style's weight."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    inv = 1.0 / tl.sqrt_rn(_row_sum_of_squares(x_row, N, False, 0.0, BLOCK) / N + eps)
    cols = tl.arange(0, BLOCK)
    for start in range(0, N, BLOCK):
        ok = start + cols < N
        x = tl.load(x_row + start + cols, mask=ok, other=0.0)
        w = tl.load(w_ptr + start + cols, mask=ok, other=0.0)
        xn = x.to(tl.float32) * inv
        if STYLE == 0:
            y = w * xn.to(x.dtype)
        elif STYLE == 1:
            y = w.to(tl.float32) * xn
        else:
            y = xn * (1.0 + w.to(tl.float32))
        out = out_ptr + row * stride_out + start + cols
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def layer_norm_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, stride_x, stride_out, N, eps, BLOCK: tl.constexpr
):
    """One program per row: `(x - mean) / sqrt(var + eps) * w + b` in float32 (biased var)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    mean = _row_sum(x_row, N, BLOCK) / N
    inv = 1.0 / tl.sqrt_rn(_row_sum_of_squares(x_row, N, True, mean, BLOCK) / N + eps)
    cols = tl.arange(0, BLOCK)
    for start in range(0, N, BLOCK):
        ok = start + cols < N
        x = tl.load(x_row + start + cols, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + start + cols, mask=ok, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + start + cols, mask=ok, other=0.0).to(tl.float32)
        y = (x - mean) * inv * w + b
        out = out_ptr + row * stride_out + start + cols
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def l2_normalize_kernel(x_ptr, out_ptr, stride_x, stride_out, N, eps, BLOCK: tl.constexpr):
    """One program per row: `x / max(||x||_2, eps)` (torch's `F.normalize`), norm in float32."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    norm = tl.maximum(tl.sqrt_rn(_row_sum_of_squares(x_row, N, False, 0.0, BLOCK)), eps)
    cols = tl.arange(0, BLOCK)
    for start in range(0, N, BLOCK):
        ok = start + cols < N
        x = tl.load(x_row + start + cols, mask=ok, other=0.0).to(tl.float32)
        out = out_ptr + row * stride_out + start + cols
        tl.store(out, (x / norm).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def softmax_kernel(x_ptr, out_ptr, stride_x, stride_out, N, LOG: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: softmax (or log-softmax with LOG) in float32. Pass 1 keeps a
    running max and sum per lane over the row's chunks, in order; pass 2 writes."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, N, BLOCK):
        x = tl.load(x_row + start + cols, mask=start + cols < N, other=float("-inf"))
        x = x.to(tl.float32)
        m_new = tl.maximum(m, x)
        shift = tl.where(m_new > float("-inf"), m_new, 0.0)  # lanes that saw only -inf
        s = s * tl.exp(m - shift) + tl.exp(x - shift)
        m = m_new
    row_max = tl.max(m, axis=0)
    total = tl.sum(s * tl.exp(m - row_max), axis=0)
    log_total = row_max + tl.log(total)
    for start in range(0, N, BLOCK):
        ok = start + cols < N
        x = tl.load(x_row + start + cols, mask=ok, other=0.0).to(tl.float32)
        y = x - log_total if LOG else tl.exp(x - row_max) / total
        out = out_ptr + row * stride_out + start + cols
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=ok)
