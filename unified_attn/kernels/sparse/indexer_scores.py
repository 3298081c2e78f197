"""DeepSeek-V4's lightning-indexer scores over the paged indexer cache.

For query token t of request r and compressed entry e of r (its key `k[e]`, `D` features, in the
`indexer` cache at `(blocks[r, e], offsets[e])`), the score is

    score[t, e] = sum_h w[t, h] * relu(q[t, h] . k[e]) * scale

for the entries the token sees (`e < num_visible[t]`: complete at its position) and -inf for
the others. A program owns one token and BLOCK_E entries: it gathers the entries' keys into one
tile, takes every head's dot products in one matrix product `[H, D] x [D, BLOCK_E]`, and reduces
over the heads in registers. A tile wholly past the token's visible entries loads nothing and
stores -inf, so the work follows each token's own length, not the step's longest (or, in a
CUDA-graph step, `max_model_len`'s). Nothing of size `[T, E, D]` is built: only the scores
`[T, E]` (float32) are written, which the backend's top-k then reads.
"""

import triton
import triton.language as tl


@triton.jit
def indexer_scores_kernel(
    out_ptr,  # [T, E] float32
    q_ptr,  # [T, H, D]
    w_ptr,  # [T, H] float32
    cache_ptr,  # [num_blocks, entries_per_block, D], contiguous features
    blocks_ptr,  # [B, E] int32 or int64: the block of each request's entry e
    offsets_ptr,  # [E] int32 or int64: entry e's slot in its block (the same in every request)
    request_ptr,  # [T] int64: the request of each token
    visible_ptr,  # [T] int32 or int64: entries 0 .. num_visible - 1 are seen
    scale,
    num_heads,
    num_entries,  # E
    stride_qt,
    stride_qh,
    stride_wt,
    stride_cb,
    stride_cs,
    stride_bb,  # row stride of blocks
    stride_ot,
    H: tl.constexpr,  # heads, padded to a power of two >= 16
    D: tl.constexpr,
    BLOCK_E: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    entries = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    in_range = entries < num_entries
    count = tl.load(visible_ptr + t)
    seen = in_range & (entries < count)
    scores = tl.full([BLOCK_E], float("-inf"), tl.float32)
    if tl.program_id(1) * BLOCK_E < count:  # the tile holds a visible entry
        heads = tl.arange(0, H)
        dims = tl.arange(0, D)
        head_ok = heads < num_heads
        q = tl.load(
            q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :],
            mask=head_ok[:, None],
            other=0.0,
        )
        w = tl.load(w_ptr + t * stride_wt + heads, mask=head_ok, other=0.0)
        r = tl.load(request_ptr + t)
        block = tl.load(blocks_ptr + r * stride_bb + entries, mask=seen, other=0).to(tl.int64)
        slot = tl.load(offsets_ptr + entries, mask=seen, other=0).to(tl.int64)
        rows = block * stride_cb + slot * stride_cs
        keys = tl.load(cache_ptr + rows[:, None] + dims[None, :], mask=seen[:, None], other=0.0)
        dots = tl.dot(q, tl.trans(keys), input_precision=DOT_PRECISION)  # [H, BLOCK_E]
        weighted = tl.sum(tl.maximum(dots, 0.0) * scale * w[:, None], axis=0)
        scores = tl.where(seen, weighted, float("-inf"))
    tl.store(out_ptr + t * stride_ot + entries, scores, mask=in_range)
