"""Gated delta rule prefill over many requests: each program runs the recurrence of
`gated_delta_update` token by token for one (request, value head, `BLOCK_V` columns), its
`[Dk, BLOCK_V]` float32 state tile in registers, from the state read to the state written.

Exact (the per-token recurrence, not the chunked WY form), so a checkpoint may fall after any
row: entry j of a request's checkpoint row receives the state after absolute position
`(offset // CHUNK + 1 + j) * CHUNK`, as the Mamba-2 scan's (`ssd_chunked.py`). Sequential in
tokens; the next token's inputs are loaded while the current one is computed.
"""

import triton
import triton.language as tl

from unified_attn.kernels.ssm.gated_delta_update import delta_step, load_qk


@triton.jit
def gated_delta_varlen_kernel(
    q_ptr,  # [T, Hk, Dk]
    k_ptr,  # [T, Hk, Dk]
    v_ptr,  # [T, Hv, Dv]
    g_ptr,  # [T, Hv] float32 log decay
    beta_ptr,  # [T, Hv] float32
    o_ptr,  # [T, Hv, Dv]
    query_start_loc_ptr,  # [R + 1] int32
    offsets_ptr,  # [R] int32: tokens before this step
    states_ptr,  # [num_blocks, Hv, Dk, Dv] float32
    read_slots_ptr,  # [R] int32, -1: start from zeros
    write_slots_ptr,  # [R] int32, -1: do not write
    checkpoints_ptr,  # [R, M] int32, -1: none
    num_checkpoints,  # M
    chunk_size,
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
    stride_ot,
    stride_oh,
    stride_sb,
    stride_sh,
    stride_sk,
    stride_cr,
    HEADS_PER_KEY: tl.constexpr,
    K_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    L2NORM: tl.constexpr,
    HAS_CHECKPOINTS: tl.constexpr,
):
    request = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dk = tl.arange(0, BLOCK_K)
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    dk_ok = dk < K_DIM
    dv_ok = dv < V_DIM
    tile_ok = dk_ok[:, None] & dv_ok[None, :]
    start = tl.load(query_start_loc_ptr + request)
    end = tl.load(query_start_loc_ptr + request + 1)
    offset = tl.load(offsets_ptr + request)
    read_slot = tl.load(read_slots_ptr + request).to(tl.int64)
    write_slot = tl.load(write_slots_ptr + request).to(tl.int64)
    tile = head * stride_sh + dk[:, None] * stride_sk + dv[None, :]
    state = tl.load(states_ptr + read_slot * stride_sb + tile,
                    mask=tile_ok & (read_slot >= 0), other=0.0)  # fmt: skip

    key_head = head // HEADS_PER_KEY
    q_row = q_ptr + key_head * stride_qh
    k_row = k_ptr + key_head * stride_kh
    v_row = v_ptr + head * stride_vh + dv
    o_row = o_ptr + head * stride_oh + dv
    first_row = start.to(tl.int64)
    row = first_row
    ok = row < end
    q, k = load_qk(q_row + row * stride_qt, k_row + row * stride_kt, dk, dk_ok & ok, scale,
                   eps, L2NORM)  # fmt: skip
    v = tl.load(v_row + row * stride_vt, mask=dv_ok & ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_gt + head, mask=ok, other=0.0)
    beta = tl.load(beta_ptr + row * stride_bt + head, mask=ok, other=0.0)
    first_checkpoint = offset // chunk_size + 1
    for i in range(0, end - start):
        row = first_row + i + 1  # the next token's inputs, loaded ahead
        ok = row < end
        q_next, k_next = load_qk(q_row + row * stride_qt, k_row + row * stride_kt, dk,
                                 dk_ok & ok, scale, eps, L2NORM)  # fmt: skip
        v_next = tl.load(v_row + row * stride_vt, mask=dv_ok & ok, other=0.0)
        g_next = tl.load(g_ptr + row * stride_gt + head, mask=ok, other=0.0)
        beta_next = tl.load(beta_ptr + row * stride_bt + head, mask=ok, other=0.0)

        state, o = delta_step(state, q, k, v, g, beta)
        tl.store(o_row + (row - 1) * stride_ot, o.to(o_ptr.dtype.element_ty), mask=dv_ok)
        if HAS_CHECKPOINTS:
            position = offset + i + 1
            entry = position // chunk_size - first_checkpoint
            if (position % chunk_size == 0) & (entry < num_checkpoints):
                slot = tl.load(checkpoints_ptr + request * stride_cr + entry).to(tl.int64)
                tl.store(states_ptr + slot * stride_sb + tile, state,
                         mask=tile_ok & (slot >= 0))  # fmt: skip
        q, k, v, g, beta = q_next, k_next, v_next.to(tl.float32), g_next, beta_next
    tl.store(states_ptr + write_slot * stride_sb + tile, state,
             mask=tile_ok & (write_slot >= 0))  # fmt: skip
