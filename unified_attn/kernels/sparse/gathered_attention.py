"""Shared-KV attention over gathered cache rows, as a partial softmax (DeepSeek-V4).

Each query token t attends over its own list of `S` cache rows, `(blocks[t, s], offsets[t, s])`
where `valid[t, s]`: a sliding window of roped latents, or the compressed entries a top-k
selection names. The row is both key and value (shared-KV MQA: one KV head of `D` features).
A program owns one token and BH of its query heads; the programs of one token's head groups are
adjacent in the grid, so a row read by one group is still in L2 for the next. It walks the list
in tiles of TILE rows with an online softmax (log2 units: `exp2`, with log2(e) folded into the
scale) and stores the normalised output and the natural log-sum-exp of the visible scores (-inf
and a zero output where the token sees no row), which `v4_ops.gathered_attention_sets` merges
with the other set's partial and the sinks (where the one-launch Hopper kernel does not run).

With SPLIT, each program walks one `segment` of the list and writes a partial
(normalised output in float32 and log2-sum-exp) that `merge_partials_kernel` merges; the grid is
(head groups, splits, tokens). On sm90 the Hopper kernel (gathered_attention_sm90.py) runs
instead for 16-bit data.

With INDEX_AHEAD the list entries of the next tile are loaded while the current tile is used, so
a row tile's address never depends on a load of the same loop iteration and the compiler can keep
several row tiles in flight (multi-buffered); without it each tile waits for its own entries.
Measured on an H100 and not kept: the tile's rows as the dots' M side (scores [TILE, BH], for
head groups under 64), list entries carried two tiles ahead (the pipeliner then drops the
asynchronous copies), and an L2 prefetch of the lists (within 2%); `benchmarks/README.md`.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _row_offsets(blocks_ptr, offsets_ptr, valid_ptr, idx, end, stride_cb, stride_cs):
    """Element offsets of the list entries `idx` in the cache and whether each is visible. The
    three loads are independent (masked by the end of the program's part of the list only, not
    by `valid`), so a tile's addresses wait for one load latency, not two; hidden entries get
    offset 0."""
    in_list = idx < end
    valid = tl.load(valid_ptr + idx, mask=in_list, other=0) != 0
    block = tl.load(blocks_ptr + idx, mask=in_list, other=0).to(tl.int64)
    slot = tl.load(offsets_ptr + idx, mask=in_list, other=0).to(tl.int64)
    return tl.where(valid, block * stride_cb + slot * stride_cs, 0), valid


@triton.jit
def gathered_attention_kernel(
    out_ptr,  # [T, H, D] query dtype
    lse_ptr,  # [T, H] float32
    q_ptr,  # [T, H, D]
    cache_ptr,  # [num_blocks, block_size, D], any block / slot strides, contiguous features
    blocks_ptr,  # [T, S] int32 or int64
    offsets_ptr,  # [T, S] int32 or int64
    valid_ptr,  # [T, S] uint8
    part_out_ptr,  # SPLIT: [T, H, num_splits, D] float32
    part_lse_ptr,  # SPLIT: [T, H, num_splits] float32, log2 units
    scale,
    num_heads,
    num_rows,  # S
    segment,  # rows per split (a multiple of TILE); num_rows without a split
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_it,  # row stride of blocks / offsets / valid
    BH: tl.constexpr,
    D: tl.constexpr,
    TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INDEX_AHEAD: tl.constexpr,
    SPLIT: tl.constexpr,
):
    heads = tl.program_id(0) * BH + tl.arange(0, BH)
    split = tl.program_id(1)
    t = tl.program_id(2).to(tl.int64)
    begin = split * segment
    end = tl.minimum(begin + segment, num_rows)
    head_ok = heads < num_heads
    dims = tl.arange(0, D)
    q = tl.load(
        q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=head_ok[:, None],
        other=0.0,
    )
    acc = tl.zeros([BH, D], dtype=tl.float32)
    qk_scale = scale * LOG2E
    blocks_ptr += t * stride_it
    offsets_ptr += t * stride_it
    valid_ptr += t * stride_it
    m_i = tl.full([BH], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    idx = tl.arange(0, TILE)
    row_off, valid = _row_offsets(
        blocks_ptr, offsets_ptr, valid_ptr, begin + idx, end, stride_cb, stride_cs
    )
    for start in range(begin, end, TILE):
        if not INDEX_AHEAD:
            row_off, valid = _row_offsets(
                blocks_ptr, offsets_ptr, valid_ptr, start + idx, end, stride_cb, stride_cs
            )
        rows = tl.load(
            cache_ptr + row_off[:, None] + dims[None, :], mask=valid[:, None], other=0.0
        )  # [TILE, D]: keys and values
        tile_valid = valid
        if INDEX_AHEAD:  # the next tile's entries, loaded while this one is used
            row_off, valid = _row_offsets(
                blocks_ptr, offsets_ptr, valid_ptr, start + TILE + idx, end, stride_cb, stride_cs
            )  # fmt: skip
        s = tl.dot(q, tl.trans(rows), input_precision=DOT_PRECISION) * qk_scale  # [BH, TILE]
        s = tl.where(tile_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pv = tl.dot(p.to(rows.dtype), rows, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    seen = l_i > 0.0
    norm = tl.where(seen, l_i, 1.0)
    lse2 = tl.where(seen, m_i + tl.log2(norm), float("-inf"))
    if SPLIT:  # this part of the list's partial, merged by `merge_partials_kernel`
        part = (t * num_heads + heads) * tl.num_programs(1) + split
        tl.store(part_out_ptr + part[:, None] * D + dims[None, :], acc / norm[:, None],
                 mask=head_ok[:, None])  # fmt: skip
        tl.store(part_lse_ptr + part, lse2, mask=head_ok)
    else:
        tl.store(
            out_ptr + t * stride_ot + heads[:, None] * stride_oh + dims[None, :],
            (acc / norm[:, None]).to(out_ptr.dtype.element_ty),
            mask=head_ok[:, None],
        )
        tl.store(lse_ptr + t * num_heads + heads, lse2 * LN2, mask=head_ok)
