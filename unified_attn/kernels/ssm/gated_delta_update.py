"""Gated delta rule decode (Qwen3-Next's linear attention): one token per request, on a pool of
float32 state blocks `[num_blocks, Hv, Dk, Dv]`.

    S = exp(g) S          S = S + k (beta (v - S^T k))^T          o = S^T (scale q)

q and k are shared by the `Hv / Hk` value heads of a key head. Memory-bound: each program
streams one `[Dk, BLOCK_V]` float32 tile of a head's state in and out, tile-major
(`ssd_update.state_tile`), the state written streaming (`.cs`, it is not read again this step):
H200, batch 64-256, 0.83-0.88 -> 0.92-0.95 of the copy bandwidth.
"""

import triton
import triton.language as tl

from unified_attn.kernels.ssm.ssd_update import state_tile


@triton.jit
def load_qk(q_ptr, k_ptr, dk, mask, scale, eps, L2NORM: tl.constexpr):
    """A key head's q and k `[BLOCK_K]` in float32, L2-normalised if L2NORM, q times scale."""
    q = tl.load(q_ptr + dk, mask=mask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + dk, mask=mask, other=0.0).to(tl.float32)
    if L2NORM:
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps)
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
    return q * scale, k


@triton.jit
def delta_step(state, q, k, v, g, beta):
    """One token through a `[BLOCK_K, BLOCK_V]` state tile -> (new state, o `[BLOCK_V]`)."""
    state = state * tl.exp(g)
    predicted = tl.sum(state * k[:, None], axis=0)
    delta = (v - predicted) * beta
    state = state + k[:, None] * delta[None, :]
    return state, tl.sum(state * q[:, None], axis=0)


@triton.jit
def gated_delta_update_kernel(
    q_ptr,  # [R, Hk, Dk]
    k_ptr,  # [R, Hk, Dk]
    v_ptr,  # [R, Hv, Dv]
    g_ptr,  # [R, Hv] float32 log decay
    beta_ptr,  # [R, Hv] float32
    o_ptr,  # [R, Hv, Dv]
    states_ptr,  # [num_blocks, Hv, Dk, Dv] float32
    read_slots_ptr,  # [R] int32, -1: start from zeros
    write_slots_ptr,  # [R] int32, -1: do not write
    scale,
    eps,
    num_heads,
    stride_qr,
    stride_qh,
    stride_kr,
    stride_kh,
    stride_vr,
    stride_vh,
    stride_gr,
    stride_br,
    stride_or,
    stride_oh,
    stride_sb,
    stride_sh,
    stride_sk,
    HEADS_PER_KEY: tl.constexpr,
    K_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    L2NORM: tl.constexpr,
):
    request, head, v_tile = state_tile(num_heads, (V_DIM + BLOCK_V - 1) // BLOCK_V)
    dk = tl.arange(0, BLOCK_K)
    dv = v_tile * BLOCK_V + tl.arange(0, BLOCK_V)
    dk_ok = dk < K_DIM
    dv_ok = dv < V_DIM
    tile_ok = dk_ok[:, None] & dv_ok[None, :]
    read_slot = tl.load(read_slots_ptr + request).to(tl.int64)
    write_slot = tl.load(write_slots_ptr + request).to(tl.int64)
    tile = head * stride_sh + dk[:, None] * stride_sk + dv[None, :]
    state = tl.load(states_ptr + read_slot * stride_sb + tile,
                    mask=tile_ok & (read_slot >= 0), other=0.0)  # fmt: skip

    key_head = head // HEADS_PER_KEY
    q, k = load_qk(q_ptr + request * stride_qr + key_head * stride_qh,
                   k_ptr + request * stride_kr + key_head * stride_kh, dk, dk_ok, scale, eps,
                   L2NORM)  # fmt: skip
    v = tl.load(v_ptr + request * stride_vr + head * stride_vh + dv, mask=dv_ok, other=0.0)
    g = tl.load(g_ptr + request * stride_gr + head)
    beta = tl.load(beta_ptr + request * stride_br + head)
    state, o = delta_step(state, q, k, v.to(tl.float32), g, beta)
    tl.store(o_ptr + request * stride_or + head * stride_oh + dv,
             o.to(o_ptr.dtype.element_ty), mask=dv_ok)  # fmt: skip
    tl.store(states_ptr + write_slot * stride_sb + tile, state,
             mask=tile_ok & (write_slot >= 0), cache_modifier=".cs")  # fmt: skip
