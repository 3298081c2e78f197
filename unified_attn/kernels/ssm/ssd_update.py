"""Mamba-2 decode: one token per request through the SSD recurrence, on a pool of state blocks.

    dt = clamp(softplus(dt_raw + dt_bias), lo, hi)     S = exp(dt * A) * S + dt * x^T B
    y = S C + D * x

Memory-bound: each program streams one `[BLOCK_P, N]` float32 tile of a state block in and out.
The programs run tile-major (`state_tile`): consecutive programs stream adjacent memory.
"""

import triton
import triton.language as tl

from unified_attn.kernels.pdl_jit import pdl_start


@triton.jit
def discretize_dt(dt_raw, dt_bias, dt_min, dt_max):
    """`clamp(softplus(dt_raw + dt_bias), dt_min, dt_max)` in float32 (softplus as torch's:
    the identity above 20)."""
    v = dt_raw.to(tl.float32) + dt_bias
    v = tl.where(v <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(v, 20.0))), v)
    return tl.minimum(tl.maximum(v, dt_min), dt_max)


@triton.jit
def state_tile(num_heads, NUM_TILES: tl.constexpr):
    """(request int64, head, tile) of this program in a 1-D grid of `R * num_heads * NUM_TILES`
    programs, tiles fastest, then heads: consecutive programs read and write adjacent memory of
    one state block (H200: 0.87 -> 0.97 of the copy bandwidth at 64-256 requests against
    request-major programs, which touch a different block each)."""
    pid = tl.program_id(0)
    per_request = num_heads * NUM_TILES
    return (pid // per_request).to(tl.int64), (pid % per_request) // NUM_TILES, pid % NUM_TILES


@triton.jit
def ssd_state_update_kernel(
    x_ptr,  # [R, H, P]
    dt_ptr,  # [R, H] raw
    dt_bias_ptr,  # [H] float32
    A_ptr,  # [H] float32
    B_ptr,  # [R, G, N]
    C_ptr,  # [R, G, N]
    D_ptr,  # [H] float32
    y_ptr,  # [R, H, P]
    states_ptr,  # [num_blocks, H, P, N] float32
    read_slots_ptr,  # [R] int32, -1: start from zeros
    write_slots_ptr,  # [R] int32, -1: do not write
    dt_min,
    dt_max,
    num_heads,
    stride_xr,
    stride_xh,
    stride_dtr,
    stride_br,
    stride_bg,
    stride_cr,
    stride_cg,
    stride_yr,
    stride_yh,
    stride_sb,
    stride_sh,
    stride_sp,
    HEADS_PER_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    STATE_DIM: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    launch_pdl: tl.constexpr,  # kernels/pdl.py
):
    pdl_start(launch_pdl)
    request, head, p_tile = state_tile(num_heads, (HEAD_DIM + BLOCK_P - 1) // BLOCK_P)
    p = p_tile * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok = p < HEAD_DIM
    n_ok = n < STATE_DIM
    tile_ok = p_ok[:, None] & n_ok[None, :]
    read_slot = tl.load(read_slots_ptr + request).to(tl.int64)
    write_slot = tl.load(write_slots_ptr + request).to(tl.int64)
    tile = head * stride_sh + p[:, None] * stride_sp + n[None, :]
    state = tl.load(states_ptr + read_slot * stride_sb + tile, mask=tile_ok & (read_slot >= 0),
                    other=0.0, eviction_policy="evict_first")  # fmt: skip

    dt = discretize_dt(tl.load(dt_ptr + request * stride_dtr + head),
                       tl.load(dt_bias_ptr + head), dt_min, dt_max)  # fmt: skip
    decay = tl.exp(dt * tl.load(A_ptr + head))
    group = head // HEADS_PER_GROUP
    b = tl.load(B_ptr + request * stride_br + group * stride_bg + n, mask=n_ok, other=0.0)
    c = tl.load(C_ptr + request * stride_cr + group * stride_cg + n, mask=n_ok, other=0.0)
    x = tl.load(x_ptr + request * stride_xr + head * stride_xh + p, mask=p_ok, other=0.0)
    x = x.to(tl.float32)
    state = state * decay + (x * dt)[:, None] * b.to(tl.float32)[None, :]
    y = tl.sum(state * c.to(tl.float32)[None, :], axis=1) + tl.load(D_ptr + head) * x
    tl.store(y_ptr + request * stride_yr + head * stride_yh + p,
             y.to(y_ptr.dtype.element_ty), mask=p_ok)  # fmt: skip
    tl.store(states_ptr + write_slot * stride_sb + tile, state,
             mask=tile_ok & (write_slot >= 0), cache_modifier=".cs")  # fmt: skip
