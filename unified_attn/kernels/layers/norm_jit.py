"""RMSNorm kernels (launchers: `norm.py`), numerically `models.layers.RMSNorm`: the sum of squares
and the scaling in float32, the weight applied in the order of the norm's style.

Rows up to `BLOCK` wide stay in registers, `ROWS` of them per program (one load of x, one store);
longer rows (`CHUNKED`) take two passes over chunks of `BLOCK`, one row per program. Either way a
row's reduction order is fixed by its width and the tile, never by the number of rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from unified_attn.kernels.pdl_jit import pdl_start


@triton.jit
def _scale(x, inv, w, STYLE: tl.constexpr):
    """`x * inv` in float32, scaled by the weight as the style says: 0 `llama`
    (`w * (x * inv).to(x.dtype)`), 1 `float32` (`w * (x * inv)`), 2 `gemma`
    (`(x * inv) * (1 + w)`); the caller's store rounds the result."""
    xn = x.to(tl.float32) * inv
    wf = w.to(tl.float32)
    if STYLE == 0:
        return wf * xn.to(x.dtype).to(tl.float32)
    elif STYLE == 1:
        return wf * xn
    else:
        return xn * (1.0 + wf)


@triton.jit
def _add_residual(x, r_ptrs, r_out_ptrs, mask):
    """`x + residual` rounded to x's dtype (as torch adds), stored as the new residual."""
    r = tl.load(r_ptrs, mask=mask, other=0.0)
    x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    tl.store(r_out_ptrs, x, mask=mask)
    return x


@triton.jit
def rms_norm_kernel(
    x_ptr,  # [R_outer, R_inner, N]: row r at (r // R_inner, r % R_inner); last dim contiguous
    w_ptr,  # [N]
    out_ptr,  # [R, N] contiguous
    r_ptr,  # [R, N] the residual (HAS_RESIDUAL; R_inner == 1)
    r_out_ptr,  # [R, N] the new residual `x + residual` (HAS_RESIDUAL)
    num_rows,
    inner,
    stride_outer,
    stride_inner,
    stride_r,
    stride_r_out,
    N,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    STYLE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNKED: tl.constexpr,
    launch_pdl: tl.constexpr = False,  # kernels/pdl.py
):
    pdl_start(launch_pdl)
    pid = tl.program_id(0).to(tl.int64)
    if CHUNKED:  # ROWS == 1
        x_row = x_ptr + (pid // inner) * stride_outer + (pid % inner) * stride_inner
        _norm_chunked(
            x_row,
            w_ptr,
            out_ptr + pid * N,
            r_ptr + pid * stride_r,
            r_out_ptr + pid * stride_r_out,
            N,
            eps,
            HAS_RESIDUAL,
            STYLE,
            BLOCK,
        )
    else:
        rows = pid * ROWS + tl.arange(0, ROWS)
        x_rows = x_ptr + (rows // inner) * stride_outer + (rows % inner) * stride_inner
        cols = tl.arange(0, BLOCK)
        mask = (rows < num_rows)[:, None] & (cols < N)[None, :]
        x = tl.load(x_rows[:, None] + cols[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            x = _add_residual(
                x,
                r_ptr + rows[:, None] * stride_r + cols[None, :],
                r_out_ptr + rows[:, None] * stride_r_out + cols[None, :],
                mask,
            )
        xf = x.to(tl.float32)
        inv = 1.0 / tl.sqrt_rn(tl.sum(xf * xf, axis=1) / N + eps)
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
        y = _scale(x, inv[:, None], w[None, :], STYLE)
        tl.store(out_ptr + rows[:, None] * N + cols[None, :],
                 y.to(out_ptr.dtype.element_ty), mask=mask)  # fmt: skip


@triton.jit
def _norm_chunked(
    x_row, w_ptr, out_row, r_row, r_out_row, N, eps,
    HAS_RESIDUAL: tl.constexpr, STYLE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One row in two passes: the sum of squares (storing the new residual), then the scaling,
    which reads x back (the new residual with HAS_RESIDUAL, which the same lanes wrote)."""
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, N, BLOCK):
        ok = start + cols < N
        x = tl.load(x_row + start + cols, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            x = _add_residual(x, r_row + start + cols, r_out_row + start + cols, ok)
        xf = x.to(tl.float32)
        acc += xf * xf
    inv = 1.0 / tl.sqrt_rn(tl.sum(acc, axis=0) / N + eps)
    source = x_row
    if HAS_RESIDUAL:
        source = r_out_row
    for start in range(0, N, BLOCK):
        ok = start + cols < N
        x = tl.load(source + start + cols, mask=ok, other=0.0)
        w = tl.load(w_ptr + start + cols, mask=ok, other=0.0)
        y = _scale(x, inv, w, STYLE)
        tl.store(out_row + start + cols, y.to(out_row.dtype.element_ty), mask=ok)
