"""Unified paged attention: prefill, chunked prefill, decode and mixed batches in one launch.

A program owns BLOCK_Q query tokens of one sequence times the QPK query heads of one KV head
(BLOCK_M = BLOCK_Q * QPK rows), so every K/V tile is read once per KV head. The grid's first axis
is an upper bound on query blocks (`num_tokens // BLOCK_Q + num_seqs`); a program finds its
sequence by binary search over `query_start_loc` and exits when idle. Windows and chunks bound the
KV loop. Query j of a causal sequence sits at position `seq_len - q_len + j` (a chunk's queries
come last); non-causal sequences (encoder self-attention, cross-attention) number their queries
from 0, so a query chunk may be longer than its keys (cross-attention) and every query row still
sees keys `[0, seq_len)` under no window or chunk. With NUM_SEGMENTS > 1 (split-KV, decode),
segment s covers keys `[b + s * L, b + (s + 1) * L)` (b: the tile of the first key a window or
chunk leaves; the last segment takes every key after, segment 0 the sink tokens), L the request's
share in whole tiles, at most the plan's `segment_len` (a graph keeps the plan of `max_model_len`),
and stores a partial result that `merge_segments.py` combines.

An fp8 (e4m3) cache is dequantized in registers (exact): each K/V tile is loaded as float8 and
converted to the query dtype, but bf16 queries run float16 dots (one conversion per two values,
not three; a query row over 2^14 first divided by a power of two); the K scale is folded into the
softmax scale, the V scale into the accumulator before it is normalised or stored.
"""

import triton
import triton.language as tl

from unified_attn.kernels.pdl_jit import pdl_start


@triton.jit
def find_seq(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """Largest sequence (request) index i with `query_start_loc[i] // BLOCK_Q + i <= q_block`."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid)
        if start // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


LOG2E = tl.constexpr(1.4426950408889634)  # scores are kept in log2 units: exp2 is one instruction


@triton.jit
def _load_kv(ptrs, key_valid, dim_valid, MASKED: tl.constexpr, PADDED: tl.constexpr):
    """A `[TILE, HEAD_PAD]` K or V tile; masked keys and padding dimensions read as 0."""
    if MASKED:
        tile = tl.load(ptrs, mask=key_valid[:, None] & dim_valid[None, :], other=0.0)
    elif PADDED:
        tile = tl.load(ptrs, mask=dim_valid[None, :], other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def _tile_blocks(
    table_row_ptr, tile_start, hi, offs_t, BLOCK_SIZE: tl.constexpr, PAGE_TILES: tl.constexpr
):
    """Block-table entries of the tile at `tile_start`: one (PAGE_TILES) or one per key; 0 past
    `hi`. With TABLE_AHEAD they are loaded one tile ahead and carried through the loop, so the
    K/V loads' addresses do not depend on a load of their own iteration and Triton's pipeliner
    multi-buffers them (a same-iteration table load leaves the K/V tiles single-buffered)."""
    if PAGE_TILES:
        block = tl.load(table_row_ptr + tile_start // BLOCK_SIZE, mask=tile_start < hi, other=0)
    else:
        key_pos = tile_start + offs_t
        block = tl.load(table_row_ptr + key_pos // BLOCK_SIZE, mask=key_pos < hi, other=0)
    return block


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, row_factor, slope, q_pos, dims, dim_valid, offs_t, k_inv, v_inv,
    tile_start, lo, hi, block, kv_head, k_cache_ptr, v_cache_ptr, table_row_ptr, v_minus_k,
    soft_cap, stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh,
    stride_vd,
    MASKED: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, CHUNK: tl.constexpr,
    SINK_TOKENS: tl.constexpr, USE_ALIBI: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SHARED_KV_OFFSETS: tl.constexpr, FP8_KV: tl.constexpr,
    PAGE_TILES: tl.constexpr, TABLE_AHEAD: tl.constexpr,
):  # fmt: skip
    """One key tile `[tile_start, tile_start + TILE)` of the online softmax. MASKED tiles check
    every key against `[lo, hi)` and every (row, key) pair against the causal / window / chunk
    rules; unmasked tiles are ones every row of the program sees whole (no compare, no select,
    no load mask). PAGE_TILES: the tile lies inside one page, so one block-table entry and the
    loop-invariant offsets `k_inv` / `v_inv` address it. `block` holds this tile's table
    entries (`_tile_blocks`) and the next tile's are returned (TABLE_AHEAD; else `block` is
    unused, the entries are read here and it is returned as it is)."""
    key_pos = tile_start + offs_t
    key_valid = (key_pos >= lo) & (key_pos < hi)
    carried = block
    if not TABLE_AHEAD:
        block = _tile_blocks(table_row_ptr, tile_start, hi, offs_t, BLOCK_SIZE, PAGE_TILES)
    if PAGE_TILES:
        block = block.to(tl.int64)
        slot0 = tile_start % BLOCK_SIZE
        k_ptrs = k_cache_ptr + (block * stride_kb + slot0 * stride_ks + kv_head * stride_kh) + k_inv
        if SHARED_KV_OFFSETS:
            v_ptrs = k_ptrs + v_minus_k
        else:
            v_base = block * stride_vb + slot0 * stride_vs + kv_head * stride_vh
            v_ptrs = v_cache_ptr + v_base + v_inv
    else:
        block = block.to(tl.int64)
        slot = key_pos % BLOCK_SIZE
        k_row = block * stride_kb + slot * stride_ks + kv_head * stride_kh
        k_ptrs = k_cache_ptr + k_row[:, None] + dims[None, :] * stride_kd
        if SHARED_KV_OFFSETS:  # the halves of one page: V's addresses are K's + a constant
            v_ptrs = k_ptrs + v_minus_k
        else:
            v_row = block * stride_vb + slot * stride_vs + kv_head * stride_vh
            v_ptrs = v_cache_ptr + v_row[:, None] + dims[None, :] * stride_vd
    k = _load_kv(k_ptrs, key_valid, dim_valid, MASKED, HEAD_PAD != HEAD_SIZE)
    if FP8_KV:  # exact: every e4m3 value is a value of the dot dtype
        k = k.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * row_factor[:, None]
    if USE_SOFTCAP or USE_ALIBI:  # row_factor left the scores in natural-log units
        if USE_SOFTCAP:
            # c * tanh(s / c), overflow-safe: tanh(x) = 1 - 2 / (exp(2x) + 1)
            s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0))
        if USE_ALIBI:
            s += slope[:, None] * (key_pos[None, :] - q_pos[:, None]).to(tl.float32)
        s = s * LOG2E
    if MASKED:
        visible = key_valid[None, :]
        if CAUSAL:
            visible &= key_pos[None, :] <= q_pos[:, None]
        if WINDOW > 0:
            in_window = q_pos[:, None] - key_pos[None, :] < WINDOW
            if not CAUSAL:
                in_window &= key_pos[None, :] - q_pos[:, None] < WINDOW
            visible &= in_window | (key_pos[None, :] < SINK_TOKENS)
        if CHUNK > 0:
            visible &= key_pos[None, :] // CHUNK == q_pos[:, None] // CHUNK
        s = tl.where(visible, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # fully masked rows stay finite
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    v = _load_kv(v_ptrs, key_valid, dim_valid, MASKED, HEAD_PAD != HEAD_SIZE)
    if FP8_KV:
        v = v.to(q.dtype)
    acc += tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    if TABLE_AHEAD:
        next_start = tile_start + offs_t.shape[0]
        carried = _tile_blocks(table_row_ptr, next_start, hi, offs_t, BLOCK_SIZE, PAGE_TILES)
    return acc, m_new, l_i, carried


@triton.jit
def unified_attention_kernel(
    out_ptr,  # [T, Hq, D]
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D], any strides
    v_cache_ptr,
    block_table_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32: keys of each sequence
    query_start_loc_ptr,  # [B + 1] int32
    sinks_ptr,  # [Hq] float32 or dummy
    alibi_ptr,  # [Hq] float32 or dummy
    kv_scales_ptr,  # [2] float32 (k_scale, v_scale) of an fp8 cache, else a dummy
    seg_acc_ptr,  # [T, Hq, NUM_SEGMENTS, HEAD_PAD] float32 (split-KV only)
    seg_max_ptr,  # [T, Hq, NUM_SEGMENTS] (log2 units)
    seg_sum_ptr,  # [T, Hq, NUM_SEGMENTS]
    scale,
    soft_cap,
    num_seqs,
    num_q_heads,
    segment_len,  # the most keys a split-KV segment takes (runtime: no recompile per length)
    v_minus_k,  # elements from the K view's start to the V view's (SHARED_KV_OFFSETS)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    QPK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE: tl.constexpr,
    CAUSAL: tl.constexpr,  # False: queries at positions 0..q_len-1, keys 0..seq_len-1
    WINDOW: tl.constexpr,  # 0: none; else a query sees keys q - WINDOW < k <= q
    CHUNK: tl.constexpr,  # 0: none; else keys of the query's own chunk
    SINK_TOKENS: tl.constexpr,  # StreamingLLM: the first keys stay visible outside the window
    USE_SINKS: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for exact float32 dots, else "tf32"
    SHARED_KV_OFFSETS: tl.constexpr,  # V = K's offsets + v_minus_k (same strides, one storage)
    FP8_KV: tl.constexpr,  # the caches are float8 e4m3: dequantize with the scales
    SPLIT_MASKING: tl.constexpr,  # False: mask every tile (batch-invariant mode)
    TABLE_AHEAD: tl.constexpr,  # read the block table one tile ahead (multi-buffered K/V)
    launch_pdl: tl.constexpr = False,  # kernels/pdl.py
):
    pdl_start(launch_pdl)
    q_block, kv_head, segment = tl.program_id(0), tl.program_id(1), tl.program_id(2)

    seq = find_seq(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    local_block = q_block - (q_begin // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len if CAUSAL else 0

    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_PAD)
    q_idx = local_block * BLOCK_Q + rows // QPK  # query index inside the sequence
    head = kv_head * QPK + rows % QPK
    row_valid = q_idx < q_len
    dim_valid = dims < HEAD_SIZE
    q_pos = context_len + q_idx  # absolute position of each row's query
    token = q_begin + q_idx

    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )

    # Keys any row of this program may see: [key_lo, key_hi).
    first_pos = context_len + local_block * BLOCK_Q
    last_pos = context_len + tl.minimum(local_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    key_lo = 0
    key_hi = seq_len
    if CAUSAL:
        key_hi = last_pos + 1
    if WINDOW > 0:
        key_lo = tl.maximum(first_pos - WINDOW + 1, 0)
        if not CAUSAL:
            key_hi = tl.minimum(last_pos + WINDOW, seq_len)
    if CHUNK > 0:
        key_lo = first_pos // CHUNK * CHUNK
        if not CAUSAL:
            key_hi = tl.minimum((last_pos // CHUNK + 1) * CHUNK, seq_len)
    # StreamingLLM sink tokens: a first key range [sink_lo, sink_hi), always all of them (the
    # main range starts above), so every row adds its sink keys in the same tile whatever
    # position the program's first query has (batch invariance under any prompt chunking).
    sink_lo = 0
    sink_hi = 0
    if SINK_TOKENS > 0:
        sink_hi = tl.minimum(SINK_TOKENS, key_hi)
        key_lo = tl.maximum(key_lo, sink_hi)
    if NUM_SEGMENTS > 1:  # the keys a window or chunk leaves, from the tile of the first
        base = key_lo // TILE * TILE
        share = tl.cdiv(tl.cdiv(key_hi - base, NUM_SEGMENTS), TILE) * TILE  # whole tiles
        seg_len = tl.minimum(segment_len, share)
        seg_lo = base + segment * seg_len
        seg_hi = key_hi
        if segment < NUM_SEGMENTS - 1:  # the last segment takes every key left
            seg_hi = tl.minimum(key_hi, seg_lo + seg_len)
        key_lo = tl.maximum(key_lo, seg_lo)
        key_hi = seg_hi
        if segment > 0:  # segment 0 takes the sink tokens
            sink_hi = sink_lo

    if USE_SINKS and NUM_SEGMENTS == 1:
        # The sink: a virtual key, no value (running max: its logit; running sum: exp(0) = 1).
        m_i = tl.load(sinks_ptr + head, mask=row_valid, other=float("-inf")).to(tl.float32)
        m_i = m_i * LOG2E
        l_i = tl.where(m_i > float("-inf"), 1.0, 0.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    qk_scale = scale
    if FP8_KV:
        qk_scale = scale * tl.load(kv_scales_ptr)
    if not (USE_SOFTCAP or USE_ALIBI):
        qk_scale = qk_scale * LOG2E  # straight to log2 units
    # bf16 queries over an fp8 cache: the dots run in float16, whose conversion from e4m3 is
    # one instruction per two values (bf16 takes three). Each query row is first divided by a
    # power of two that brings it under 2^14 (exact; the factor multiplies its scores), so no
    # bf16 value overflows float16; probabilities (<= 1) and e4m3 values (<= 448) fit as they are.
    F16_DOTS: tl.constexpr = FP8_KV and q_ptr.dtype.element_ty == tl.bfloat16
    row_factor = tl.full([BLOCK_M], 1.0, dtype=tl.float32) * qk_scale
    if F16_DOTS:
        q_f32 = q.to(tl.float32)
        amax = tl.max(tl.abs(q_f32), axis=1)
        row_scale = tl.where(amax > 16384.0, tl.exp2(tl.ceil(tl.log2(amax / 16384.0))), 1.0)
        q = (q_f32 / row_scale[:, None]).to(tl.float16)
        row_factor = row_factor * row_scale
    slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_ALIBI:
        slope = tl.load(alibi_ptr + head, mask=row_valid, other=0.0).to(tl.float32)

    offs_t = tl.arange(0, TILE)
    PAGE_TILES: tl.constexpr = BLOCK_SIZE % TILE == 0  # every tile lies inside one page
    table_row = block_table_ptr + seq * stride_bt
    k_inv = offs_t[:, None] * stride_ks + dims[None, :] * stride_kd
    v_inv = offs_t[:, None] * stride_vs + dims[None, :] * stride_vd

    # Tiles in ascending key order, at absolute multiples of TILE: the sink range (masked), then
    # the main range [key_lo, key_hi) as masked tiles up to the first one every row sees whole,
    # those unmasked, and masked tiles to the end (the causal diagonal). Four loops, one
    # `_attend_tile` call each: one loop over all masked tiles was 9% slower (H100 decode).
    main_start = key_lo // TILE * TILE
    clean_start = main_start
    clean_end = main_start
    if SPLIT_MASKING:
        full_lo = key_lo
        full_hi = key_hi
        if CAUSAL:
            full_hi = tl.minimum(full_hi, first_pos + 1)
        if WINDOW > 0:
            full_lo = tl.maximum(full_lo, last_pos - WINDOW + 1)
            if not CAUSAL:
                full_hi = tl.minimum(full_hi, first_pos + WINDOW)
        if CHUNK > 0:
            full_lo = tl.maximum(full_lo, last_pos // CHUNK * CHUNK)
            full_hi = tl.minimum(full_hi, (first_pos // CHUNK + 1) * CHUNK)
        # (clamped to key_hi: a window can round the first whole tile past the last key)
        clean_start = tl.minimum(tl.cdiv(full_lo, TILE) * TILE, key_hi)
        clean_end = tl.maximum(full_hi // TILE * TILE, clean_start)
    if SINK_TOKENS > 0:
        sink_start = sink_lo // TILE * TILE
        blocks = _tile_blocks(table_row, sink_start, sink_hi, offs_t, BLOCK_SIZE, PAGE_TILES)
        for tile_start in range(sink_start, sink_hi, TILE):
            acc, m_i, l_i, blocks = _attend_tile(
                acc, m_i, l_i, q, row_factor, slope, q_pos, dims, dim_valid, offs_t, k_inv,
                v_inv, tile_start, sink_lo, sink_hi, blocks, kv_head, k_cache_ptr,
                v_cache_ptr, table_row, v_minus_k, soft_cap, stride_kb, stride_ks, stride_kh,
                stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
                True, BLOCK_SIZE, HEAD_SIZE, HEAD_PAD, CAUSAL, WINDOW, CHUNK, SINK_TOKENS,
                USE_ALIBI, USE_SOFTCAP, DOT_PRECISION, SHARED_KV_OFFSETS, FP8_KV, PAGE_TILES,
                TABLE_AHEAD,
            )  # fmt: skip
    if SPLIT_MASKING:
        blocks = _tile_blocks(table_row, main_start, key_hi, offs_t, BLOCK_SIZE, PAGE_TILES)
        for tile_start in range(main_start, clean_start, TILE):
            acc, m_i, l_i, blocks = _attend_tile(
                acc, m_i, l_i, q, row_factor, slope, q_pos, dims, dim_valid, offs_t, k_inv,
                v_inv, tile_start, key_lo, key_hi, blocks, kv_head, k_cache_ptr,
                v_cache_ptr, table_row, v_minus_k, soft_cap, stride_kb, stride_ks, stride_kh,
                stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
                True, BLOCK_SIZE, HEAD_SIZE, HEAD_PAD, CAUSAL, WINDOW, CHUNK, SINK_TOKENS,
                USE_ALIBI, USE_SOFTCAP, DOT_PRECISION, SHARED_KV_OFFSETS, FP8_KV, PAGE_TILES,
                TABLE_AHEAD,
            )  # fmt: skip
        blocks = _tile_blocks(table_row, clean_start, key_hi, offs_t, BLOCK_SIZE, PAGE_TILES)
        for tile_start in range(clean_start, clean_end, TILE):
            acc, m_i, l_i, blocks = _attend_tile(
                acc, m_i, l_i, q, row_factor, slope, q_pos, dims, dim_valid, offs_t, k_inv,
                v_inv, tile_start, key_lo, key_hi, blocks, kv_head, k_cache_ptr,
                v_cache_ptr, table_row, v_minus_k, soft_cap, stride_kb, stride_ks, stride_kh,
                stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
                False, BLOCK_SIZE, HEAD_SIZE, HEAD_PAD, CAUSAL, WINDOW, CHUNK, SINK_TOKENS,
                USE_ALIBI, USE_SOFTCAP, DOT_PRECISION, SHARED_KV_OFFSETS, FP8_KV, PAGE_TILES,
                TABLE_AHEAD,
            )  # fmt: skip
    blocks = _tile_blocks(table_row, clean_end, key_hi, offs_t, BLOCK_SIZE, PAGE_TILES)
    for tile_start in range(clean_end, key_hi, TILE):
        acc, m_i, l_i, blocks = _attend_tile(
            acc, m_i, l_i, q, row_factor, slope, q_pos, dims, dim_valid, offs_t, k_inv,
            v_inv, tile_start, key_lo, key_hi, blocks, kv_head, k_cache_ptr,
            v_cache_ptr, table_row, v_minus_k, soft_cap, stride_kb, stride_ks, stride_kh,
            stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
            True, BLOCK_SIZE, HEAD_SIZE, HEAD_PAD, CAUSAL, WINDOW, CHUNK, SINK_TOKENS,
            USE_ALIBI, USE_SOFTCAP, DOT_PRECISION, SHARED_KV_OFFSETS, FP8_KV, PAGE_TILES,
            TABLE_AHEAD,
        )  # fmt: skip

    if FP8_KV:
        acc = acc * tl.load(kv_scales_ptr + 1)

    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )
    else:
        row = (token * num_q_heads + head) * NUM_SEGMENTS + segment
        tl.store(seg_max_ptr + row, m_i, mask=row_valid)
        tl.store(seg_sum_ptr + row, l_i, mask=row_valid)
        tl.store(
            seg_acc_ptr + row[:, None] * HEAD_PAD + dims[None, :],
            acc,
            mask=row_valid[:, None],
        )
