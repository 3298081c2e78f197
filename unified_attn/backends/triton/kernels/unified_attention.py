"""Unified paged attention: prefill, chunked prefill, decode and mixed batches in one launch.

A program owns BLOCK_Q query tokens of one sequence times the QPK query heads of one KV head
(BLOCK_M = BLOCK_Q * QPK rows), so every K/V tile is read once per KV head. The grid's first axis
is an upper bound on query blocks (`num_tokens // BLOCK_Q + num_seqs`); a program finds its
sequence by binary search over `query_start_loc` and exits when idle. Windows and chunks bound the
KV loop. Query j of a causal sequence sits at position `seq_len - q_len + j` (a chunk's queries
come last); non-causal sequences (encoder self-attention, cross-attention) number their queries
from 0, so a query chunk may be longer than its keys (cross-attention) and every query row still
sees keys `[0, seq_len)` under no window or chunk. With NUM_SEGMENTS > 1 (split-KV, decode),
segment s covers keys `[s * segment_len, (s + 1) * segment_len)` (the last one everything after)
and stores an unnormalised partial result that `merge_segments_kernel` combines.

An fp8 (e4m3) cache is dequantized in registers: each K/V tile is loaded as float8 and converted
to the dot dtype (exact: every e4m3 value is a float16/bfloat16/float32 value): the query dtype,
except that bf16 queries run float16 dots (one conversion instruction per two values instead of
three; each query row divided by a power of two first where it exceeds 2^14); the K scale is
folded into the softmax scale (`s = (q . k) * scale * k_scale`) and the V scale into the
accumulator before it is normalised or stored, so the scales cost two scalar loads per program.
"""

import triton
import triton.language as tl


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """Largest sequence index i with `query_start_loc[i] // BLOCK_Q + i <= q_block`."""
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
    seg_max_ptr,  # [T, Hq, NUM_SEGMENTS]
    seg_sum_ptr,  # [T, Hq, NUM_SEGMENTS]
    scale,
    soft_cap,
    num_seqs,
    num_q_heads,
    segment_len,  # keys per split-KV segment (runtime: no recompile per context length)
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
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    seq = _find_seq(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q)
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
    if NUM_SEGMENTS > 1:
        seg_lo = segment * segment_len
        seg_hi = key_hi
        if segment < NUM_SEGMENTS - 1:  # the last segment takes every key left
            seg_hi = tl.minimum(key_hi, (segment + 1) * segment_len)
        key_lo = tl.maximum(key_lo, seg_lo)
        key_hi = seg_hi
        sink_lo = tl.maximum(sink_lo, seg_lo)
        sink_hi = tl.minimum(sink_hi, seg_hi)

    if USE_SINKS and NUM_SEGMENTS == 1:
        # The sink is a virtual key with no value: the running max starts at its logit and
        # the running sum at exp(0) = 1.
        m_i = tl.load(sinks_ptr + head, mask=row_valid, other=float("-inf")).to(tl.float32)
        l_i = tl.where(m_i > float("-inf"), 1.0, 0.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    qk_scale = scale
    if FP8_KV:
        qk_scale = scale * tl.load(kv_scales_ptr)
    # bf16 queries over an fp8 cache: the dots run in float16, whose conversion from e4m3 is
    # one instruction per two values (bf16 takes three). Each query row is first divided by a
    # power of two that brings it under 2^14 (exact; the factor multiplies its scores), so no
    # bf16 value overflows float16; probabilities (<= 1) and e4m3 values (<= 448) fit as they are.
    F16_DOTS: tl.constexpr = FP8_KV and q_ptr.dtype.element_ty == tl.bfloat16
    row_scale = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    if F16_DOTS:
        q_f32 = q.to(tl.float32)
        amax = tl.max(tl.abs(q_f32), axis=1)
        row_scale = tl.where(amax > 16384.0, tl.exp2(tl.ceil(tl.log2(amax / 16384.0))), 1.0)
        q = (q_f32 / row_scale[:, None]).to(tl.float16)
    if USE_ALIBI:
        slope = tl.load(alibi_ptr + head, mask=row_valid, other=0.0).to(tl.float32)

    offs_t = tl.arange(0, TILE)
    sink_start = sink_lo // TILE * TILE
    num_sink_tiles = tl.maximum(tl.cdiv(sink_hi - sink_start, TILE), 0)
    main_start = key_lo // TILE * TILE
    num_tiles = num_sink_tiles + tl.maximum(tl.cdiv(key_hi - main_start, TILE), 0)
    for t in range(0, num_tiles):
        in_sinks = t < num_sink_tiles
        tile_start = tl.where(
            in_sinks, sink_start + t * TILE, main_start + (t - num_sink_tiles) * TILE
        )
        lo = tl.where(in_sinks, sink_lo, key_lo)
        hi = tl.where(in_sinks, sink_hi, key_hi)
        key_pos = tile_start + offs_t
        key_valid = (key_pos >= lo) & (key_pos < hi)
        block = tl.load(
            block_table_ptr + seq * stride_bt + key_pos // BLOCK_SIZE, mask=key_valid, other=0
        ).to(tl.int64)
        slot_off = key_pos % BLOCK_SIZE
        # [TILE, HEAD_PAD] element offsets, computed once for K and (when the views share
        # strides, as the halves of one page do) for V as well: address math is the hot path.
        k_offs = (block * stride_kb + slot_off * stride_ks + kv_head * stride_kh)[:, None] + (
            dims[None, :] * stride_kd
        )
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_cache_ptr + k_offs, mask=kv_mask, other=0.0)  # [TILE, HEAD_PAD]
        if FP8_KV:
            k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if F16_DOTS:
            s = s * row_scale[:, None]
        if USE_SOFTCAP:
            # c * tanh(s / c), overflow-safe: tanh(x) = 1 - 2 / (exp(2x) + 1)
            s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0))
        if USE_ALIBI:
            s += slope[:, None] * (key_pos[None, :] - q_pos[:, None]).to(tl.float32)
        visible = row_valid[:, None] & key_valid[None, :]
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
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]

        if SHARED_KV_OFFSETS:
            v = tl.load(k_cache_ptr + v_minus_k + k_offs, mask=kv_mask, other=0.0)
        else:
            v_offs = (block * stride_vb + slot_off * stride_vs + kv_head * stride_vh)[:, None] + (
                dims[None, :] * stride_vd
            )
            v = tl.load(v_cache_ptr + v_offs, mask=kv_mask, other=0.0)  # [TILE, HEAD_PAD]
        if FP8_KV:
            v = v.to(q.dtype)
        acc += tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

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


@triton.jit
def merge_segments_kernel(
    out_ptr,  # [T, Hq, D]
    seg_acc_ptr,  # [T, Hq, NUM_SEGMENTS, HEAD_PAD]
    seg_max_ptr,  # [T, Hq, NUM_SEGMENTS]
    seg_sum_ptr,
    sinks_ptr,
    num_q_heads,
    stride_ot,
    stride_oh,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    """Log-sum-exp merge of the partial results of one (token, head). Empty segments carry
    max = -inf and sum = 0 and drop out; the sink is counted here, once."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    segs = tl.arange(0, NUM_SEGMENTS)
    dims = tl.arange(0, HEAD_PAD)
    base = (token * num_q_heads + head) * NUM_SEGMENTS
    m = tl.load(seg_max_ptr + base + segs)
    sums = tl.load(seg_sum_ptr + base + segs)
    m_all = tl.max(m, axis=0)
    if USE_SINKS:
        m_all = tl.maximum(m_all, tl.load(sinks_ptr + head).to(tl.float32))
    m_safe = tl.where(m_all > float("-inf"), m_all, 0.0)
    weight = tl.where(m > float("-inf"), tl.exp(m - m_safe), 0.0)
    total = tl.sum(sums * weight, axis=0)
    if USE_SINKS:
        total += tl.exp(tl.load(sinks_ptr + head).to(tl.float32) - m_safe)
    acc = tl.load(seg_acc_ptr + (base + segs)[:, None] * HEAD_PAD + dims[None, :])
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_SIZE,
    )
