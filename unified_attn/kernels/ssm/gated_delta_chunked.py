"""Gated delta rule prefill over many requests in the chunked (WY) form, on a pool of float32
state blocks `[num_blocks, Hv, Dk, Dv]`.

Chunks of CHUNK = 64 rows hold one request's rows and end at absolute positions that are
multiples of CHUNK (a request with `offset` earlier tokens starts with a chunk of
`CHUNK - offset % CHUNK` rows), as the Mamba-2 scan's (`ssd_chunked.py`). Three launches:

1. `ssd_chunked.chunk_plan_kernel`: chunk c -> (request, first row, rows); request -> its first
   chunk. Chunk slots past the real count get request -1 and are skipped.
2. `gated_delta_wy.chunk_wy_kernel`, program (chunk, value head), all in parallel: the chunk's
   cumulative log decay g, `w`, `u` and the causal scores `P` of its WY form.
3. `chunk_state_kernel`, program (request, value head, BLOCK_V state columns): walks the
   request's chunks in order with its `[Dk, BLOCK_V]` float32 state tile S in registers,

       v_new = u - w S          o = (scale exp(g) q_n) S + P v_new
       S = exp(g_last) S + (k_n exp(g_last - g))^T v_new

   (q_n, k_n: the rows as loaded times the row factors `chunk_wy_kernel` stored), and stores
   S to each checkpoint that ends a chunk and to the write slot. The outputs come from the
   same pass: no per-chunk states are kept.

Checkpoint entry j of a request receives the state after absolute position
`(offset // chunk_size + 1 + j) * chunk_size`; chunk_size is a multiple of CHUNK, so every such
position ends a chunk. Dot operands are q, k and the scratch in their dtype (the state cast to
it) with float32 accumulation; "ieee" products for float32 inputs.
"""

import triton
import triton.language as tl

from unified_attn.kernels.ssm.gated_delta_wy import CHUNK, chunk_rows


@triton.jit
def chunk_state_kernel(
    q_ptr,  # [T, Hk, Dk]
    k_ptr,  # [T, Hk, Dk]
    w_ptr,  # [NC, Hv, CHUNK, Dk]
    u_ptr,  # [NC, Hv, CHUNK, Dv]
    scores_ptr,  # [NC, Hv, CHUNK, CHUNK]: P
    factors_ptr,  # [NC, Hv, 3, CHUNK] float32: q's and k's row factors, g
    o_ptr,  # [T, Hv, Dv]
    chunk_start_ptr,  # [NC] int32
    chunk_len_ptr,  # [NC] int32
    request_first_chunk_ptr,  # [R] int32
    query_start_loc_ptr,  # [R + 1] int32
    offsets_ptr,  # [R] int32: tokens before this step
    states_ptr,  # [num_blocks, Hv, Dk, Dv] float32
    read_slots_ptr,  # [R] int32, -1: start from zeros
    write_slots_ptr,  # [R] int32, -1: do not write
    checkpoints_ptr,  # [R, M] int32, -1: none
    num_checkpoints,  # M
    chunk_size,  # checkpoint spacing, a multiple of CHUNK
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_wc,
    stride_wh,
    stride_uc,
    stride_uh,
    stride_pc,
    stride_ph,
    stride_fc,
    stride_fh,
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
    HAS_CHECKPOINTS: tl.constexpr,
    DOT: tl.constexpr,  # tl.dot input precision: "ieee" for float32 inputs
):
    request = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dk = tl.arange(0, BLOCK_K)
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    dk_ok = dk < K_DIM
    dv_ok = dv < V_DIM
    tile_ok = dk_ok[:, None] & dv_ok[None, :]
    start = tl.load(query_start_loc_ptr + request)
    length = tl.load(query_start_loc_ptr + request + 1) - start
    offset = tl.load(offsets_ptr + request)
    count = tl.where(length > 0, (offset % CHUNK + length + CHUNK - 1) // CHUNK, 0)
    first = tl.load(request_first_chunk_ptr + request)
    read_slot = tl.load(read_slots_ptr + request).to(tl.int64)
    write_slot = tl.load(write_slots_ptr + request).to(tl.int64)
    tile = head * stride_sh + dk[:, None] * stride_sk + dv[None, :]
    state = tl.load(states_ptr + read_slot * stride_sb + tile,
                    mask=tile_ok & (read_slot >= 0), other=0.0)  # fmt: skip

    key_head = head // HEADS_PER_KEY
    q_row = q_ptr + key_head * stride_qh
    k_row = k_ptr + key_head * stride_kh
    o_row = o_ptr + head * stride_oh
    rows = tl.arange(0, CHUNK)
    dt = w_ptr.dtype.element_ty
    first_checkpoint = offset // chunk_size + 1
    for j in range(0, count):
        chunk = (first + j).to(tl.int64)
        row0 = tl.load(chunk_start_ptr + chunk).to(tl.int64)
        n = tl.load(chunk_len_ptr + chunk)
        w = chunk_rows(w_ptr + chunk * stride_wc + head * stride_wh, CHUNK, K_DIM, dk, dk_ok)
        u = chunk_rows(u_ptr + chunk * stride_uc + head * stride_uh, CHUNK, V_DIM, dv, dv_ok)
        p = tl.load(scores_ptr + chunk * stride_pc + head * stride_ph + rows[:, None] * CHUNK
                    + rows[None, :])  # fmt: skip
        factors = factors_ptr + chunk * stride_fc + head * stride_fh
        q_factor = tl.load(factors + rows)
        k_factor = tl.load(factors + CHUNK + rows)
        g_last = tl.load(factors + 3 * CHUNK - 1)
        q = chunk_rows(q_row + row0 * stride_qt, n, stride_qt, dk, dk_ok)
        k = chunk_rows(k_row + row0 * stride_kt, n, stride_kt, dk, dk_ok)

        s = state.to(dt)
        v_new = u.to(tl.float32) - tl.dot(w, s, input_precision=DOT)
        o = tl.dot(q, s, input_precision=DOT) * q_factor[:, None]
        o = tl.dot(p, v_new.to(dt), o, input_precision=DOT)
        out_ok = (rows < n)[:, None] & dv_ok[None, :]
        tl.store(o_row + row0 * stride_ot + rows[:, None] * stride_ot + dv[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=out_ok)  # fmt: skip
        update = (v_new * k_factor[:, None]).to(dt)
        state = state * tl.exp(g_last) + tl.dot(tl.trans(k), update, input_precision=DOT)

        if HAS_CHECKPOINTS:
            position = offset + (row0 - start + n)
            entry = position // chunk_size - first_checkpoint
            if (position % chunk_size == 0) & (entry < num_checkpoints):
                slot = tl.load(checkpoints_ptr + request * stride_cr + entry).to(tl.int64)
                tl.store(states_ptr + slot * stride_sb + tile, state,
                         mask=tile_ok & (slot >= 0))  # fmt: skip
    tl.store(states_ptr + write_slot * stride_sb + tile, state,
             mask=tile_ok & (write_slot >= 0))  # fmt: skip
