"""DeepSeek MLA attention with weight absorption, over a paged latent cache.

Every cached token is one latent vector `[L + R]`: the normed compressed KV `c [L]` then the roped
`k_pe [R]`. It is the key of every query head (all L + R dims) and its first L dims are the
value, so the attention is MQA-shaped: one shared "KV head" for all H query heads, and a query
row is the absorbed `q_nope @ W_UK [L]` concatenated with the roped `q_pe [R]`.

A program owns BLOCK_Q query tokens of one request times BLOCK_H heads (BLOCK_M = BLOCK_Q *
BLOCK_H rows; row r is token `r // BLOCK_H`, head `r % BLOCK_H`) and one key segment. It loads
its query rows once, then walks the segment BLOCK_N keys at a time: the key tile
`[BLOCK_N, L + R]` is loaded once as its `c` part and its `k_pe` part, scored as
`q_nope @ c^T + q_pe @ k_pe^T` (two tensor-core dots), and the same loaded `c` tile is the value
tile of `p @ c`. The online softmax runs in base 2 (`scale * log2(e)` is folded into the
scores).

Grid: (head blocks, query blocks, segments), head blocks fastest, so the programs that read one
request's keys run side by side and share them in L2. Query blocks are either exact (every
request has UNIFORM_QUERY_LEN tokens: decode, spec-decode verification) or an upper bound
(`T // BLOCK_Q + B`) where a program finds its request by binary search over `query_start_loc`
and exits when idle. Token j of a request sits at position `seq_len - q_len + j` and sees keys
`[0, position]`; a padding row (`seq_len` 0) sees none and writes zeros.

Keys are read through the block table. With TILE_IN_PAGE (the page size a multiple of BLOCK_N and
tiles starting at multiples of BLOCK_N) a tile lies inside one page: one block-table load per
tile, a scalar base pointer and loop-invariant 32-bit offsets. Otherwise (any page size) every
key looks up its own page.

Split-KV (flash-decoding, SPLIT): segment s covers keys `[s * segment_len, (s + 1) *
segment_len)` (the last segment everything after, so a plan made for shorter contexts stays
correct), and writes its rows' normalised partial output and log2-sum-exp to float32 scratch;
`merge_partials_kernel` (merge_partials.py) combines the segments of each (token, head). Empty
segments write lse = -inf and drop out of the merge.

An fp8 (e4m3) latent cache (FP8) is dequantized in registers, as the paged kernel does
(unified_attention.py): each tile is loaded as float8 and converted to the dot dtype (exact),
which is float16 for bf16 queries (one conversion instruction per two values instead of three;
each query row is first divided by a power of two that brings it under 2^14, and that factor
multiplies its scores). The cache's scale is folded into the softmax scale and into the
accumulator before it is normalised: one scalar load per program.

SWAP_AB computes the products with the keys as the MMA rows: scores^T = c q^T and out^T +=
c^T p^T, the accumulator kept as `[L, BLOCK_M]`. With 16 query rows the heads then fill the
narrow N side of an MMA instead of a padded M side; the fp8 path's 16-row tiles use it (the
dequantized key tile spilled registers in the usual orientation).
"""

import triton
import triton.language as tl

from unified_attn.kernels.attention.unified_attention import find_seq


@triton.jit
def _online_softmax_step(s, m_i, l_i):
    """Fold the base-2 scores `s [BLOCK_M, BLOCK_N]` (masked keys at -inf) into the running max
    and sum; returns the probabilities, the factor `alpha [BLOCK_M]` that rescales what was
    accumulated, and the new state. A row that has seen no key yet
    keeps max -inf: its shift is 0, so nothing becomes NaN.

    The rescale runs on every tile: skipping it while no row's max grows much (FlashAttention-4's
    lazy rescale) was tried and measured 1.4x slower on an H100 (the branch keeps both versions
    of the [64, 512] accumulator live: 50 spilled registers instead of 6)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@triton.jit
def _fp8_queries(q_nope, q_pe, qk_scale):
    """The query rows as the fp8 path's dots take them, and each row's score factor (`qk_scale`
    in log2 units, times the row's power-of-two divisor for float16 dots with bf16 queries)."""
    row_factor = tl.full([q_nope.shape[0]], 1.0, dtype=tl.float32) * qk_scale
    if q_nope.dtype == tl.bfloat16:
        nope, pe = q_nope.to(tl.float32), q_pe.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(nope), axis=1), tl.max(tl.abs(pe), axis=1))
        row_scale = tl.where(amax > 16384.0, tl.exp2(tl.ceil(tl.log2(amax / 16384.0))), 1.0)
        q_nope = (nope / row_scale[:, None]).to(tl.float16)
        q_pe = (pe / row_scale[:, None]).to(tl.float16)
        row_factor = row_factor * row_scale
    return q_nope, q_pe, row_factor


@triton.jit
def mla_attention_kernel(
    out_ptr,  # [T, H, L]
    q_ptr,  # [T, H, L + R]
    cache_ptr,  # [num_blocks, PAGE, L + R], last dim contiguous
    block_table_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32: cached keys of each request after this step
    query_start_loc_ptr,  # [B + 1] int32
    part_acc_ptr,  # [T, H, num_segments, L] float32 (SPLIT only)
    part_lse_ptr,  # [T, H, num_segments] float32, log2 units (SPLIT only)
    kv_scale_ptr,  # FP8: 0-dim float32, the latent cache's scale (else unused)
    scale_log2,  # softmax scale * log2(e)
    num_reqs,
    num_heads,
    segment_len,  # keys per segment (SPLIT; a multiple of BLOCK_N)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_bt,
    KV_LORA_RANK: tl.constexpr,  # L
    ROPE_DIM: tl.constexpr,  # R
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UNIFORM_QUERY_LEN: tl.constexpr,  # > 0: every request has this many query tokens
    TILE_IN_PAGE: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for exact float32 dots, else "tf32"
    FP8: tl.constexpr = False,  # the cache holds float8 e4m3 latents scaled by kv_scale
    SWAP_AB: tl.constexpr = False,  # products with the keys as MMA rows (module docstring)
):
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
    head_block = tl.program_id(0)
    q_block = tl.program_id(1)
    segment = tl.program_id(2)
    num_segments = tl.num_programs(2)

    if UNIFORM_QUERY_LEN > 0:
        BLOCKS_PER_REQ: tl.constexpr = (UNIFORM_QUERY_LEN + BLOCK_Q - 1) // BLOCK_Q
        req = q_block // BLOCKS_PER_REQ
        local_block = q_block % BLOCKS_PER_REQ
        q_begin = req * UNIFORM_QUERY_LEN
        q_len = UNIFORM_QUERY_LEN
    else:
        req = find_seq(query_start_loc_ptr, num_reqs, q_block, BLOCK_Q)
        q_begin = tl.load(query_start_loc_ptr + req)
        q_len = tl.load(query_start_loc_ptr + req + 1) - q_begin
        local_block = q_block - (q_begin // BLOCK_Q + req)
        if local_block * BLOCK_Q >= q_len:
            return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = local_block * BLOCK_Q + rows // BLOCK_H  # query index inside the request
    head = head_block * BLOCK_H + rows % BLOCK_H
    row_valid = (q_idx < q_len) & (head < num_heads)
    q_pos = context_len + q_idx  # absolute position: sees keys [0, q_pos]
    token = (q_begin + q_idx).to(tl.int64)

    dims_c = tl.arange(0, KV_LORA_RANK)
    dims_pe = tl.arange(0, ROPE_DIM)
    q_rows = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
    q_nope = tl.load(q_rows + dims_c[None, :], mask=row_valid[:, None], other=0.0)
    q_pe = tl.load(q_rows + KV_LORA_RANK + dims_pe[None, :], mask=row_valid[:, None], other=0.0)
    row_factor = tl.full([BLOCK_M], 1.0, dtype=tl.float32) * scale_log2  # FP8 only
    if FP8:
        q_nope, q_pe, row_factor = _fp8_queries(q_nope, q_pe, scale_log2 * tl.load(kv_scale_ptr))

    # Keys of this program: [seg_lo, seg_hi), causally bounded by its last query row.
    last_q = tl.minimum(local_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    key_hi = context_len + last_q + 1
    seg_lo = segment * segment_len
    seg_hi = key_hi
    if segment < num_segments - 1:  # the last segment takes every key left
        seg_hi = tl.minimum(key_hi, seg_lo + segment_len)
    num_tiles = tl.cdiv(tl.maximum(seg_hi - seg_lo, 0), BLOCK_N)

    offs_n = tl.arange(0, BLOCK_N)
    tile_c = offs_n[:, None] * stride_cs + dims_c[None, :]  # [BLOCK_N, L] within a page
    tile_pe = offs_n[:, None] * stride_cs + KV_LORA_RANK + dims_pe[None, :]
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SWAP_AB:  # the accumulator transposed: [L, BLOCK_M]
        acc = tl.zeros([KV_LORA_RANK, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, KV_LORA_RANK], dtype=tl.float32)
    for t in range(0, num_tiles):
        start = seg_lo + t * BLOCK_N
        keys = start + offs_n
        key_valid = keys < seg_hi
        if TILE_IN_PAGE:
            block = tl.load(table_row + start // PAGE).to(tl.int64)
            page = cache_ptr + block * stride_cb + (start % PAGE) * stride_cs
            c_ptrs = page + tile_c
            pe_ptrs = page + tile_pe
        else:
            block = tl.load(table_row + keys // PAGE, mask=key_valid, other=0).to(tl.int64)
            key_rows = cache_ptr + block * stride_cb + (keys % PAGE) * stride_cs
            c_ptrs = key_rows[:, None] + dims_c[None, :]
            pe_ptrs = key_rows[:, None] + KV_LORA_RANK + dims_pe[None, :]
        c = tl.load(c_ptrs, mask=key_valid[:, None], other=0.0)  # [BLOCK_N, L]: key and value
        k_pe = tl.load(pe_ptrs, mask=key_valid[:, None], other=0.0)  # [BLOCK_N, R]
        if FP8:  # exact: every e4m3 value is a value of the dot dtype
            c, k_pe = c.to(q_nope.dtype), k_pe.to(q_nope.dtype)

        if SWAP_AB:
            s = tl.dot(c, tl.trans(q_nope), input_precision=DOT_PRECISION)
            s = tl.trans(tl.dot(k_pe, tl.trans(q_pe), acc=s, input_precision=DOT_PRECISION))
        else:
            s = tl.dot(q_nope, tl.trans(c), input_precision=DOT_PRECISION)
            s = tl.dot(q_pe, tl.trans(k_pe), acc=s, input_precision=DOT_PRECISION)
        visible = key_valid[None, :]
        if BLOCK_Q > 1:  # decode rows see every key of the segment already
            visible = visible & (keys[None, :] <= q_pos[:, None])
        s = s * row_factor[:, None] if FP8 else s * scale_log2
        s = tl.where(visible, s, float("-inf"))
        p, alpha, m_i, l_i = _online_softmax_step(s, m_i, l_i)
        if SWAP_AB:
            acc = tl.dot(tl.trans(c), tl.trans(p.to(c.dtype)), acc=acc * alpha[None, :],
                         input_precision=DOT_PRECISION)  # fmt: skip
        else:
            acc = tl.dot(p.to(c.dtype), c, acc=acc * alpha[:, None], input_precision=DOT_PRECISION)

    if SWAP_AB:
        acc = tl.trans(acc)
    if FP8:  # the values' scale
        acc = acc * tl.load(kv_scale_ptr)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    partial = acc / l_safe[:, None]
    if SPLIT:
        part_row = (token * num_heads + head) * num_segments + segment
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + part_row, lse, mask=row_valid)
        tl.store(
            part_acc_ptr + part_row[:, None] * KV_LORA_RANK + dims_c[None, :],
            partial,
            mask=row_valid[:, None],
        )
    else:
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims_c[None, :],
            partial.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None],
        )


@triton.jit
def write_latent_cache_kernel(
    latent_ptr,  # [T, L + R], last dim contiguous
    cache_ptr,  # [num_blocks, PAGE, L + R], last dim contiguous
    slot_mapping_ptr,  # [T] int64; -1 = padding, skipped
    stride_lt,
    stride_cb,
    stride_cs,
    DIM: tl.constexpr,  # L + R
    DIM_PAD: tl.constexpr,
    PAGE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    dims = tl.arange(0, DIM_PAD)
    row = tl.load(latent_ptr + token * stride_lt + dims, mask=dims < DIM)
    dst = cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs
    tl.store(dst + dims, row, mask=dims < DIM)
