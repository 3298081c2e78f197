"""Shared-KV attention over gathered cache rows, as a partial softmax (DeepSeek-V4).

Each query token t attends over its own list of `S` cache rows, `(blocks[t, s], offsets[t, s])`
where `valid[t, s]`: a sliding window of roped latents, or the compressed entries a top-k
selection names. The row is both key and value (shared-KV MQA: one KV head of `D` features).
A program owns one token and BH of its query heads, so the token's rows are read once per BH
heads; it walks the list in tiles of TILE rows with an online softmax and stores the
normalised output and the log-sum-exp of the visible scores (-inf and a zero output where the
token sees no row), which the model merges with the other caches' partials and the sinks.
"""

import triton
import triton.language as tl


@triton.jit
def gathered_attention_kernel(
    out_ptr,  # [T, H, D] query dtype
    lse_ptr,  # [T, H] float32
    q_ptr,  # [T, H, D]
    cache_ptr,  # [num_blocks, block_size, D], any block / slot strides, contiguous features
    blocks_ptr,  # [T, S] int32
    offsets_ptr,  # [T, S] int32
    valid_ptr,  # [T, S] uint8
    scale,
    num_heads,
    num_rows,  # S
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
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    head_ok = heads < num_heads
    dims = tl.arange(0, D)
    q = tl.load(
        q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=head_ok[:, None],
        other=0.0,
    )
    m_i = tl.full([BH], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, D], dtype=tl.float32)
    for start in range(0, num_rows, TILE):
        idx = start + tl.arange(0, TILE)
        in_list = idx < num_rows
        valid = tl.load(valid_ptr + t * stride_it + idx, mask=in_list, other=0) != 0
        block = tl.load(blocks_ptr + t * stride_it + idx, mask=valid, other=0).to(tl.int64)
        slot = tl.load(offsets_ptr + t * stride_it + idx, mask=valid, other=0).to(tl.int64)
        rows = tl.load(
            cache_ptr + (block * stride_cb + slot * stride_cs)[:, None] + dims[None, :],
            mask=valid[:, None],
            other=0.0,
        )  # [TILE, D]: keys and values
        s = tl.dot(q, tl.trans(rows), input_precision=DOT_PRECISION) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(rows.dtype), rows, input_precision=DOT_PRECISION)
        m_i = m_new
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + t * stride_ot + heads[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=head_ok[:, None],
    )
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(lse_ptr + t * num_heads + heads, lse, mask=head_ok)
