"""The grouped routed-experts kernels (jit code only; the launchers are `grouped_experts.py`):
the gate/up product (up alone when ungated) with the activation, the down product, and the sum
of each token's pair outputs in choice order."""

import triton
import triton.language as tl


@triton.jit
def _block_pairs(slots_ptr, block, num_pairs, BLOCK_M: tl.constexpr):
    """A block's slot rows, the pair in each and whether it holds one (not padding)."""
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(slots_ptr + rows)
    return rows, pair, pair < num_pairs


@triton.jit
def gate_up_kernel(
    x_ptr,  # [T, D]
    w_ptr,  # ExpertWeights.gate_up
    bias_ptr,  # ExpertWeights.gate_up_bias (when HAS_BIAS)
    slots_ptr,  # [S] int32
    block_expert_ptr,  # [S / BLOCK_M] int32
    h_ptr,  # [S, I] out, x's dtype
    num_pairs,
    hidden,  # D
    inter,  # I
    stride_xt,
    stride_we,
    stride_wn,  # between output features (gate_up's columns)
    stride_wk,  # between input features
    stride_be,
    stride_hs,
    limit,
    alpha,
    TOP_K: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CLAMP: tl.constexpr,
    GPT_OSS: tl.constexpr,
    RELU2: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block, tile = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    rows, pair, valid = _block_pairs(slots_ptr, block, num_pairs, BLOCK_M)
    token = (pair // TOP_K).to(tl.int64)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xt + ks[None, :]
    w_base = w_ptr + expert * stride_we + ks[:, None] * stride_wk
    if RELU2:  # ungated: the up rows alone, no gate half
        u_ptrs = w_base + cols[None, :] * stride_wn
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k_ok = ks + k0 < hidden
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            up = tl.dot(a, w, up, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            u_ptrs += BLOCK_K * stride_wk
        if HAS_BIAS:
            up += tl.load(bias_ptr + expert * stride_be + cols, mask=col_ok,
                          other=0.0).to(tl.float32)[None, :]  # fmt: skip
    elif INTERLEAVED:  # one product over 2 * BLOCK_N alternating gate and up columns
        wide = tile * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        wide_ok = wide < 2 * inter
        w_ptrs = w_base + wide[None, :] * stride_wn
        both = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k_ok = ks + k0 < hidden
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & wide_ok[None, :], other=0.0)
            both = tl.dot(a, w, both, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        if HAS_BIAS:
            bias = tl.load(bias_ptr + expert * stride_be + wide, mask=wide_ok, other=0.0)
            both += bias.to(tl.float32)[None, :]
        gate, up = tl.split(tl.reshape(both, (BLOCK_M, BLOCK_N, 2)))
    else:  # gate rows, then up rows: two products
        g_ptrs = w_base + cols[None, :] * stride_wn
        up_offset = inter * stride_wn
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k_ok = ks + k0 < hidden
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            w_ok = k_ok[:, None] & col_ok[None, :]
            gate = tl.dot(a, tl.load(g_ptrs, mask=w_ok, other=0.0), gate,
                          input_precision=PRECISION)  # fmt: skip
            up = tl.dot(a, tl.load(g_ptrs + up_offset, mask=w_ok, other=0.0), up,
                        input_precision=PRECISION)  # fmt: skip
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K * stride_wk
        if HAS_BIAS:
            b_ptrs = bias_ptr + expert * stride_be + cols
            gate += tl.load(b_ptrs, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            up += tl.load(b_ptrs + inter, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if CLAMP:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    if RELU2:
        h = tl.maximum(up, 0.0)
        h = h * h
    elif GPT_OSS:
        h = (up + 1) * gate * tl.sigmoid(gate * alpha)
    else:
        h = gate * tl.sigmoid(gate) * up
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_hs + cols[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=col_ok[None, :])


@triton.jit
def down_kernel(
    h_ptr,  # [S, I]
    w_ptr,  # ExpertWeights.down
    bias_ptr,  # ExpertWeights.down_bias (when HAS_BIAS)
    slots_ptr,  # [S] int32
    block_expert_ptr,  # [S / BLOCK_M] int32
    weights_ptr,  # [T * k] float32: each pair's routing weight
    out_ptr,  # [T * k, D] out, h's dtype
    num_pairs,
    hidden,  # D
    inter,  # I
    stride_hs,
    stride_we,
    stride_wn,  # between output features
    stride_wk,  # between input features
    stride_be,
    stride_op,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block, tile = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    rows, pair, valid = _block_pairs(slots_ptr, block, num_pairs, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_hs + ks[None, :]
    w_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = ks + k0 < inter
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_be + cols, mask=col_ok, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    acc *= tl.load(weights_ptr + pair, mask=valid, other=0.0)[:, None]
    out_ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_op + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def sum_pairs_kernel(
    pairs_ptr,  # [T * k, D]
    out_ptr,  # [T, D]
    hidden,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Token t's k pair outputs (rows `t * k ..`) added in choice order in float32."""
    t, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(pairs_ptr + (t * TOP_K + j) * hidden + cols, mask=mask).to(tl.float32)
    tl.store(out_ptr + t * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)
