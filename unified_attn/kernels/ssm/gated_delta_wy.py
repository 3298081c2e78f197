"""Gated delta rule prefill, the parallel half of the chunked form: each chunk's WY form.

Per chunk of CHUNK = 64 rows and value head, with g the chunk's cumulative log decay (row i's
included), k_n and q_n the L2-normalised keys and queries:

    A = strictly-lower(beta_i (k_n,i . k_n,j) exp(g_i - g_j))          T = (I + A)^-1
    w = T (beta exp(g) k_n)  [64, Dk]              u = T (beta v)  [64, Dv]
    P = lower((q_n,i . k_n,j) exp(g_i - g_j)) * scale  [64, 64]: the chunk's own causal scores

so that the rows' updates given the state S before the chunk are `u - w S` (`gated_delta_math`
solves the same system). T by blocks of SUB = 16 rows: with D the diagonal blocks of A and L
the rest, `I + A = (I + D)(I + N)` with `N = (I + D)^-1 L` strictly lower by blocks (N^4 = 0),
so `T = (I - N)(I + N^2) (I + D)^-1`; the four diagonal blocks are inverted together by
forward substitution.

Dot operands are the rows as loaded (q, k and v in their dtype); the L2 norms, beta and the
decays scale the products' rows and columns in float32. Rows past a chunk's end load as zeros,
so their w, u and P rows are zero.
"""

import triton
import triton.language as tl

CHUNK = tl.constexpr(64)
SUB = tl.constexpr(16)  # rows of a diagonal block of T
BLOCKS = tl.constexpr(4)  # CHUNK // SUB


@triton.jit
def inv_norms(x, eps, L2NORM: tl.constexpr):
    """1 / ||row|| of x `[M, BLOCK_K]` in float32 (`gated_delta_math._l2norm`), or ones."""
    xf = x.to(tl.float32)
    if L2NORM:
        return tl.rsqrt(tl.sum(xf * xf, axis=1) + eps)
    return tl.sum(xf * 0.0, axis=1) + 1.0


@triton.jit
def _block_diag_inverse(a):
    """(I + D)^-1 `[CHUNK, CHUNK]` for D the `[SUB, SUB]` diagonal blocks of a strictly lower
    a: row i of a block's inverse X is `e_i - d_i. X` (rows < i already final)."""
    b = tl.arange(0, BLOCKS)
    same = b[:, None, None, None] == b[None, None, :, None]  # [BLOCKS, 1, BLOCKS, 1]
    d = tl.sum(tl.where(same, tl.reshape(a, (BLOCKS, SUB, BLOCKS, SUB)), 0.0), axis=2)
    r = tl.arange(0, SUB)
    rows, cols = r[None, :, None], r[None, None, :]
    x = tl.where(rows == cols, 1.0, d * 0.0)  # [BLOCKS, SUB, SUB]
    for i in range(1, SUB):
        d_i = tl.sum(tl.where(rows == i, d, 0.0), axis=1)  # [BLOCKS, SUB]: row i of each block
        x_i = tl.where(r[None, :] == i, 1.0, 0.0) - tl.sum(d_i[:, :, None] * x, axis=1)
        x = tl.where(rows == i, x_i[:, None, :], x)
    return tl.reshape(tl.where(same, x[:, :, None, :], 0.0), (CHUNK, CHUNK))


@triton.jit
def _unit_lower_inverse(a, INV: tl.constexpr):
    """(I + a)^-1 of a strictly lower `[CHUNK, CHUNK]` a, float32; INV: the precision of the
    products that join the diagonal blocks."""
    x = _block_diag_inverse(a)
    r = tl.arange(0, CHUNK)
    below = (r[:, None] // SUB) > (r[None, :] // SUB)
    n = tl.dot(x, tl.where(below, a, 0.0), input_precision=INV)
    n2 = tl.dot(n, n, input_precision=INV)
    m = tl.where(r[:, None] == r[None, :], 1.0, 0.0) - n + n2
    m = m - tl.dot(n, n2, input_precision=INV)  # I - N + N^2 - N^3
    return tl.dot(m, x, input_precision=INV)


@triton.jit
def chunk_rows(ptr, n, stride_t, cols, col_ok):
    """A chunk's rows `[CHUNK, cols]` from its first row at `ptr`, zeros past its `n` rows."""
    rows = tl.arange(0, CHUNK)
    mask = (rows < n)[:, None] & col_ok[None, :]
    return tl.load(ptr + rows[:, None] * stride_t + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _store_chunk(ptr, x, cols, col_ok, ROW_STRIDE: tl.constexpr):
    rows = tl.arange(0, CHUNK)
    tl.store(ptr + rows[:, None] * ROW_STRIDE + cols[None, :], x.to(ptr.dtype.element_ty),
             mask=col_ok[None, :])  # fmt: skip


@triton.jit
def chunk_wy_kernel(
    q_ptr,  # [T, Hk, Dk]
    k_ptr,  # [T, Hk, Dk]
    v_ptr,  # [T, Hv, Dv]
    g_ptr,  # [T, Hv] float32 log decay
    beta_ptr,  # [T, Hv] float32
    chunk_request_ptr,  # [NC] int32 (-1: no chunk), from ssd_chunked.chunk_plan_kernel
    chunk_start_ptr,  # [NC] int32: first row
    chunk_len_ptr,  # [NC] int32
    w_ptr,  # [NC, Hv, CHUNK, Dk] out, v's dtype
    u_ptr,  # [NC, Hv, CHUNK, Dv] out, v's dtype
    scores_ptr,  # [NC, Hv, CHUNK, CHUNK] out, v's dtype: P
    factors_ptr,  # [NC, Hv, 3, CHUNK] float32 out: q_n / q and k_n / k row factors, g
    scale,
    eps,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_bt,
    stride_wc,
    stride_wh,
    stride_uc,
    stride_uh,
    stride_pc,
    stride_ph,
    stride_fc,
    stride_fh,
    HEADS_PER_KEY: tl.constexpr,
    K_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,  # value columns per step of u
    L2NORM: tl.constexpr,
    DOT: tl.constexpr,  # tl.dot input precision of q, k, v products: "ieee" for float32
    INV: tl.constexpr,  # ... of the float32 products that assemble T
):
    """Program (chunk, value head). The factors row 0 is `scale exp(g) |q|^-1` (o's rows from
    the carried state), row 1 `exp(g_last - g) |k|^-1` (the rows' weights in the new state)."""
    chunk = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if tl.load(chunk_request_ptr + chunk) < 0:
        return
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    n = tl.load(chunk_len_ptr + chunk)
    rows = tl.arange(0, CHUNK)
    dk = tl.arange(0, BLOCK_K)
    dk_ok = dk < K_DIM
    key_head = head // HEADS_PER_KEY
    dt = v_ptr.dtype.element_ty  # q, k and v share it

    g = tl.cumsum(tl.load(g_ptr + (start + rows) * stride_gt + head, mask=rows < n, other=0.0),
                  axis=0)  # fmt: skip
    g_last = tl.sum(tl.where(rows == CHUNK - 1, g, 0.0), axis=0)
    beta = tl.load(beta_ptr + (start + rows) * stride_bt + head, mask=rows < n, other=0.0)
    k = chunk_rows(k_ptr + start * stride_kt + key_head * stride_kh, n, stride_kt, dk, dk_ok)
    q = chunk_rows(q_ptr + start * stride_qt + key_head * stride_qh, n, stride_qt, dk, dk_ok)
    k_norm = inv_norms(k, eps, L2NORM)
    q_norm = inv_norms(q, eps, L2NORM) * scale
    factors = factors_ptr + chunk * stride_fc + head * stride_fh + rows
    tl.store(factors, q_norm * tl.exp(g))
    tl.store(factors + CHUNK, tl.where(rows < n, k_norm * tl.exp(g_last - g), 0.0))
    tl.store(factors + 2 * CHUNK, g)

    gap = g[:, None] - g[None, :]
    lower = rows[:, None] >= rows[None, :]
    p = tl.dot(q, tl.trans(k), input_precision=DOT) * q_norm[:, None] * k_norm[None, :]
    p = tl.where(lower, p * tl.exp(tl.where(lower, gap, 0.0)), 0.0)
    tl.store(scores_ptr + chunk * stride_pc + head * stride_ph + rows[:, None] * CHUNK
             + rows[None, :], p.to(dt))  # fmt: skip

    strict = rows[:, None] > rows[None, :]
    a = tl.dot(k, tl.trans(k), input_precision=DOT) * (beta * k_norm)[:, None] * k_norm[None, :]
    a = tl.where(strict, a * tl.exp(tl.where(strict, gap, 0.0)), 0.0)
    t = _unit_lower_inverse(a, INV).to(dt)

    y = (k.to(tl.float32) * (beta * k_norm * tl.exp(g))[:, None]).to(dt)
    _store_chunk(w_ptr + chunk * stride_wc + head * stride_wh,
                 tl.dot(t, y, input_precision=DOT), dk, dk_ok, K_DIM)  # fmt: skip
    v_rows = v_ptr + start * stride_vt + head * stride_vh
    u_out = u_ptr + chunk * stride_uc + head * stride_uh
    for c0 in range(0, V_DIM, BLOCK_V):
        dv = c0 + tl.arange(0, BLOCK_V)
        dv_ok = dv < V_DIM
        x = (chunk_rows(v_rows, n, stride_vt, dv, dv_ok) * beta[:, None]).to(dt)
        _store_chunk(u_out, tl.dot(t, x, input_precision=DOT), dv, dv_ok, V_DIM)
