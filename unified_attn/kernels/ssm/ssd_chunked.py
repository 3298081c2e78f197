"""Mamba-2 prefill: the chunked SSD scan over many requests, on a pool of state blocks.

Chunks hold one request's rows and end at absolute positions that are multiples of CHUNK
(a request with `offset` earlier tokens starts with a chunk of `CHUNK - offset % CHUNK` rows).
The launch order is:

1. `chunk_plan_kernel`: chunk c -> (request, first row, rows); request -> its first chunk.
   Chunk slots past the real count get request -1 and every later kernel skips them.
2. `chunk_cumsum_kernel`: dt discretized and `cumsum(dt * A)` within each chunk `[H, NC, CHUNK]`
   (rows past the chunk's end get dt 0, so the last entry is the chunk's total log-decay).
3. `chunk_bmm_kernel`: `C B^T` per chunk and group `[NC, G, CHUNK, CHUNK]`, lower triangle.
4. `chunk_state_kernel`: each chunk's own state from zero, in a scratch `[NC + R, H, P, N]`:
   chunk c of request r at entry `c + r + 1`.
5. `state_passing_kernel`: per request, sequentially over its chunks, writes the state *before*
   chunk c to entry `c + r` (the entry of the previous chunk's own state, already read; the
   request's first one is its own spare entry), and stores the final state and checkpoints.
   Writing to the entry just read instead (in place) runs ~5x slower on an H200.
6. `chunk_scan_kernel`: y = decay * C S_before + causal (CB * decay * dt) x + D x.
"""

import triton
import triton.language as tl

from unified_attn.kernels.ssm.ssd_update import discretize_dt


@triton.jit
def chunk_plan_kernel(
    query_start_loc_ptr,  # [R + 1] int32
    offsets_ptr,  # [R] int32: tokens before this step
    chunk_request_ptr,  # [NC] int32 out (-1: no chunk)
    chunk_start_ptr,  # [NC] int32 out: first row
    chunk_len_ptr,  # [NC] int32 out
    request_first_chunk_ptr,  # [R] int32 out
    num_requests,
    max_chunks,
    CHUNK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_NC: tl.constexpr,
):
    pid = tl.program_id(0)
    chunk = pid * BLOCK_NC + tl.arange(0, BLOCK_NC)
    request = tl.zeros((BLOCK_NC,), dtype=tl.int32)  # requests wholly before each chunk
    before = tl.zeros((BLOCK_NC,), dtype=tl.int32)  # their chunks
    total = 0
    for r0 in range(0, num_requests, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        ok = r < num_requests
        start = tl.load(query_start_loc_ptr + r, mask=ok, other=0)
        length = tl.load(query_start_loc_ptr + r + 1, mask=ok, other=0) - start
        phase = tl.load(offsets_ptr + r, mask=ok, other=0) % CHUNK
        count = tl.where(ok & (length > 0), (phase + length + CHUNK - 1) // CHUNK, 0)
        ends = tl.cumsum(count, axis=0) + total  # [BLOCK_R]: cumulative chunk count
        done = ends[None, :] <= chunk[:, None]
        request += tl.sum(done.to(tl.int32), axis=1)
        before += tl.sum(tl.where(done, count[None, :], 0), axis=1)
        tl.store(request_first_chunk_ptr + r, ends - count, mask=ok & (pid == 0))
        total += tl.sum(count, axis=0)
    valid = (chunk < total) & (chunk < max_chunks)
    start = tl.load(query_start_loc_ptr + request, mask=valid, other=0)
    end = tl.load(query_start_loc_ptr + request + 1, mask=valid, other=0)
    phase = tl.load(offsets_ptr + request, mask=valid, other=0) % CHUNK
    j = chunk - before
    first = start + tl.maximum(j * CHUNK - phase, 0)
    last = tl.minimum(end, start + (j + 1) * CHUNK - phase)
    out = chunk < max_chunks
    tl.store(chunk_request_ptr + chunk, tl.where(valid, request, -1), mask=out)
    tl.store(chunk_start_ptr + chunk, tl.where(valid, first, 0), mask=out)
    tl.store(chunk_len_ptr + chunk, tl.where(valid, last - first, 0), mask=out)


@triton.jit
def chunk_cumsum_kernel(
    dt_ptr,  # [T, H] raw
    dt_bias_ptr,  # [H] float32
    A_ptr,  # [H] float32
    chunk_request_ptr,
    chunk_start_ptr,
    chunk_len_ptr,
    dt_out_ptr,  # [H, NC, CHUNK] float32
    log_decay_ptr,  # [H, NC, CHUNK] float32: cumsum(dt * A)
    dt_min,
    dt_max,
    num_heads,
    stride_dtt,
    stride_oh,
    stride_oc,
    CHUNK: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    chunk = tl.program_id(0)
    if tl.load(chunk_request_ptr + chunk) < 0:
        return
    start = tl.load(chunk_start_ptr + chunk)
    length = tl.load(chunk_len_ptr + chunk)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rows = tl.arange(0, CHUNK)
    head_ok = heads < num_heads
    ok = (rows < length)[:, None] & head_ok[None, :]
    raw = tl.load(dt_ptr + (start + rows)[:, None] * stride_dtt + heads[None, :], mask=ok,
                  other=0.0)  # fmt: skip
    bias = tl.load(dt_bias_ptr + heads, mask=head_ok, other=0.0)
    dt = tl.where(ok, discretize_dt(raw, bias[None, :], dt_min, dt_max), 0.0)
    a = tl.load(A_ptr + heads, mask=head_ok, other=0.0)
    log_decay = tl.cumsum(dt * a[None, :], axis=0)
    out = heads[None, :] * stride_oh + chunk * stride_oc + rows[:, None]
    tl.store(dt_out_ptr + out, dt, mask=head_ok[None, :])
    tl.store(log_decay_ptr + out, log_decay, mask=head_ok[None, :])


@triton.jit
def chunk_bmm_kernel(
    B_ptr,  # [T, G, N]
    C_ptr,  # [T, G, N]
    chunk_request_ptr,
    chunk_start_ptr,
    chunk_len_ptr,
    cb_ptr,  # [NC, G, CHUNK, CHUNK] float32
    stride_bt,
    stride_bg,
    stride_ct,
    stride_cg,
    stride_cbc,
    stride_cbg,
    STATE_DIM: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT: tl.constexpr,  # tl.dot input precision: "ieee" for float32 inputs
):
    chunk = tl.program_id(1)
    tiles_k = CHUNK // BLOCK_K
    tile_m = tl.program_id(0) // tiles_k
    tile_k = tl.program_id(0) % tiles_k
    if tile_k * BLOCK_K >= (tile_m + 1) * BLOCK_M:  # above the diagonal: never read
        return
    if tl.load(chunk_request_ptr + chunk) < 0:
        return
    group = tl.program_id(2)
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    length = tl.load(chunk_len_ptr + chunk)
    m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    k = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
    c_rows = C_ptr + (start + m)[:, None] * stride_ct + group * stride_cg
    b_rows = B_ptr + (start + k)[None, :] * stride_bt + group * stride_bg
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for n0 in range(0, STATE_DIM, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < STATE_DIM
        c = tl.load(c_rows + n[None, :], mask=(m < length)[:, None] & n_ok[None, :], other=0.0)
        b = tl.load(b_rows + n[:, None], mask=(k < length)[None, :] & n_ok[:, None], other=0.0)
        acc = tl.dot(c, b, acc, input_precision=DOT)
    tl.store(cb_ptr + chunk * stride_cbc + group * stride_cbg + m[:, None] * CHUNK
             + k[None, :], acc)  # fmt: skip


@triton.jit
def chunk_state_kernel(
    x_ptr,  # [T, H, P]
    B_ptr,  # [T, G, N]
    dt_ptr,  # [H, NC, CHUNK] float32 (discretized)
    log_decay_ptr,  # [H, NC, CHUNK] float32
    chunk_request_ptr,
    chunk_start_ptr,
    chunk_len_ptr,
    states_ptr,  # [NC + R, H, P, N] float32 out: chunk c of request r at entry c + r + 1
    stride_xt,
    stride_xh,
    stride_bt,
    stride_bg,
    stride_dh,
    stride_dc,
    stride_sc,
    stride_sh,
    stride_sp,
    HEADS_PER_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    STATE_DIM: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    DOT: tl.constexpr,  # tl.dot input precision: "ieee" for float32 inputs
):
    """The chunk's own state: `sum_l x_l^T (dt_l * exp(log_decay[last] - log_decay[l]) B_l)`."""
    head = tl.program_id(0)
    chunk = tl.program_id(2)
    request = tl.load(chunk_request_ptr + chunk)
    if request < 0:
        return
    tiles_n = tl.cdiv(STATE_DIM, BLOCK_N)
    p = (tl.program_id(1) // tiles_n) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = (tl.program_id(1) % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    length = tl.load(chunk_len_ptr + chunk)
    group = head // HEADS_PER_GROUP
    per_chunk = head * stride_dh + chunk * stride_dc
    total = tl.load(log_decay_ptr + per_chunk + CHUNK - 1)
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for l0 in range(0, length, BLOCK_L):
        rows = l0 + tl.arange(0, BLOCK_L)
        row_ok = rows < length
        x = tl.load(x_ptr + (start + rows)[None, :] * stride_xt + head * stride_xh + p[:, None],
                    mask=row_ok[None, :] & (p < HEAD_DIM)[:, None], other=0.0)  # fmt: skip
        b = tl.load(B_ptr + (start + rows)[:, None] * stride_bt + group * stride_bg
                    + n[None, :], mask=row_ok[:, None] & (n < STATE_DIM)[None, :],
                    other=0.0)  # fmt: skip
        dt = tl.load(dt_ptr + per_chunk + rows, mask=row_ok, other=0.0)
        log_decay = tl.load(log_decay_ptr + per_chunk + rows, mask=row_ok, other=0.0)
        scale = tl.where(row_ok, dt * tl.exp(total - log_decay), 0.0)
        scaled = (b.to(tl.float32) * scale[:, None]).to(x.dtype)
        acc = tl.dot(x, scaled, acc, input_precision=DOT)
    tile_ok = (p < HEAD_DIM)[:, None] & (n < STATE_DIM)[None, :]
    entry = (chunk + request + 1).to(tl.int64)
    tl.store(states_ptr + entry * stride_sc + head * stride_sh + p[:, None] * stride_sp
             + n[None, :], acc, mask=tile_ok)  # fmt: skip


@triton.jit
def state_passing_kernel(
    states_ptr,  # [NC + R, H, P, N] float32: own states in (c + r + 1), before out (c + r)
    log_decay_ptr,  # [H, NC, CHUNK] float32
    query_start_loc_ptr,  # [R + 1] int32
    offsets_ptr,  # [R] int32
    request_first_chunk_ptr,  # [R] int32
    ssm_states_ptr,  # [num_blocks, H, P, N] float32
    read_slots_ptr,
    write_slots_ptr,
    checkpoint_slots_ptr,  # [R, M] int32 (or a dummy with M = 0)
    num_checkpoints,  # M
    stride_sc,
    stride_sh,
    stride_dh,
    stride_dc,
    stride_bb,
    stride_bh,
    stride_kr,
    STATE_SIZE: tl.constexpr,  # P * N
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (request, head, tile of the flattened `[P, N]` state): walks the request's chunks
    in order. Checkpoint j of a request receives the state after its j-th chunk if that chunk
    ends on a multiple of CHUNK (every chunk but a last one that ends mid-chunk)."""
    request = tl.program_id(0)
    head = tl.program_id(1)
    e = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    e_ok = e < STATE_SIZE
    start = tl.load(query_start_loc_ptr + request)
    length = tl.load(query_start_loc_ptr + request + 1) - start
    offset = tl.load(offsets_ptr + request)
    count = tl.where(length > 0, (offset % CHUNK + length + CHUNK - 1) // CHUNK, 0)
    aligned = (offset + length) % CHUNK == 0  # does the last chunk end on a multiple?
    first = tl.load(request_first_chunk_ptr + request)
    read_slot = tl.load(read_slots_ptr + request).to(tl.int64)
    write_slot = tl.load(write_slots_ptr + request).to(tl.int64)
    tile = head * stride_bh + e
    state = tl.load(ssm_states_ptr + read_slot * stride_bb + tile, mask=e_ok & (read_slot >= 0),
                    other=0.0)  # fmt: skip
    before = states_ptr + (first + request).to(tl.int64) * stride_sc + head * stride_sh + e
    for j in range(0, count):
        chunk = (first + j).to(tl.int64)
        own = tl.load(before + stride_sc, mask=e_ok, other=0.0)
        tl.store(before, state, mask=e_ok)
        before += stride_sc
        total = tl.load(log_decay_ptr + head * stride_dh + chunk * stride_dc + CHUNK - 1)
        state = tl.exp(total) * state + own
        if j < num_checkpoints:
            slot = tl.load(checkpoint_slots_ptr + request * stride_kr + j).to(tl.int64)
            if (slot >= 0) & ((j < count - 1) | aligned):
                tl.store(ssm_states_ptr + slot * stride_bb + tile, state, mask=e_ok)
    tl.store(ssm_states_ptr + write_slot * stride_bb + tile, state,
             mask=e_ok & (write_slot >= 0))  # fmt: skip


@triton.jit
def chunk_scan_kernel(
    x_ptr,  # [T, H, P]
    C_ptr,  # [T, G, N]
    cb_ptr,  # [NC, G, CHUNK, CHUNK] float32
    dt_ptr,  # [H, NC, CHUNK] float32
    log_decay_ptr,  # [H, NC, CHUNK] float32
    states_ptr,  # [NC + R, H, P, N] float32: the state before chunk c of request r at c + r
    D_ptr,  # [H] float32
    chunk_request_ptr,
    chunk_start_ptr,
    chunk_len_ptr,
    y_ptr,  # [T, H, P]
    stride_xt,
    stride_xh,
    stride_ct,
    stride_cg,
    stride_cbc,
    stride_cbg,
    stride_dh,
    stride_dc,
    stride_sc,
    stride_sh,
    stride_sp,
    stride_yt,
    stride_yh,
    HEADS_PER_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    STATE_DIM: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT: tl.constexpr,  # tl.dot input precision: "ieee" for float32 inputs
):
    """Program (head, tile of rows x head dims, chunk); heads vary fastest so the heads of a
    group, which share C and CB, run side by side."""
    head = tl.program_id(0)
    chunk = tl.program_id(2)
    request = tl.load(chunk_request_ptr + chunk)
    if request < 0:
        return
    tiles_p = tl.cdiv(HEAD_DIM, BLOCK_P)
    tile_m = tl.program_id(1) // tiles_p
    m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    p = (tl.program_id(1) % tiles_p) * BLOCK_P + tl.arange(0, BLOCK_P)
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    length = tl.load(chunk_len_ptr + chunk)
    if tile_m * BLOCK_M >= length:
        return
    group = head // HEADS_PER_GROUP
    m_ok = m < length
    p_ok = p < HEAD_DIM
    per_chunk = head * stride_dh + chunk * stride_dc
    log_decay_m = tl.load(log_decay_ptr + per_chunk + m)
    x_dtype = x_ptr.dtype.element_ty

    # the state carried into the chunk: exp(log_decay_m) * C_m S^T
    acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    entry = (chunk + request).to(tl.int64)
    state_tile = states_ptr + entry * stride_sc + head * stride_sh + p[None, :] * stride_sp
    for n0 in range(0, STATE_DIM, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < STATE_DIM
        c = tl.load(C_ptr + (start + m)[:, None] * stride_ct + group * stride_cg + n[None, :],
                    mask=m_ok[:, None] & n_ok[None, :], other=0.0)  # fmt: skip
        s = tl.load(state_tile + n[:, None], mask=n_ok[:, None] & p_ok[None, :], other=0.0)
        acc = tl.dot(c, s.to(x_dtype), acc, input_precision=DOT)
    acc *= tl.exp(log_decay_m)[:, None]

    # the chunk's own rows, causal: (C_m B_k) exp(log_decay_m - log_decay_k) dt_k x_k
    cb_rows = cb_ptr + chunk * stride_cbc + group * stride_cbg + m[:, None] * CHUNK
    for k0 in range(0, tl.minimum((tile_m + 1) * BLOCK_M, length), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < length
        cb = tl.load(cb_rows + k[None, :])
        log_decay_k = tl.load(log_decay_ptr + per_chunk + k)
        dt_k = tl.load(dt_ptr + per_chunk + k)
        gap = tl.minimum(log_decay_m[:, None] - log_decay_k[None, :], 0.0)
        weight = tl.where(m[:, None] >= k[None, :], cb * tl.exp(gap) * dt_k[None, :], 0.0)
        x = tl.load(x_ptr + (start + k)[:, None] * stride_xt + head * stride_xh + p[None, :],
                    mask=k_ok[:, None] & p_ok[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(weight.to(x_dtype), x, acc, input_precision=DOT)

    rows_ok = m_ok[:, None] & p_ok[None, :]
    x_m = tl.load(x_ptr + (start + m)[:, None] * stride_xt + head * stride_xh + p[None, :],
                  mask=rows_ok, other=0.0)  # fmt: skip
    acc += tl.load(D_ptr + head) * x_m.to(tl.float32)
    tl.store(y_ptr + (start + m)[:, None] * stride_yt + head * stride_yh + p[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=rows_ok)  # fmt: skip
