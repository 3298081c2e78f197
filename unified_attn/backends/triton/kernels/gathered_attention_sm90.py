"""Hopper (sm90) version of the gathered shared-KV attention kernel, written in Gluon.

Same contract as `gathered_attention_kernel` (gathered_attention.py), same arguments: each query
token attends over its own list of cache rows (key = value, one KV head of D features) as a
partial softmax, optionally over one split of the list (SPLIT: the partials are merged by
`merge_partials_kernel`).

Why a second kernel: at DeepSeek-V4's decode shape (64 heads of 512) the Triton kernel cannot use
the Hopper tensor-core instructions well. With 32 heads per program the compiler falls back to
mma.sync, which streams the query and every row tile from shared memory into registers per
warp; with 64 heads it uses wgmma but runs out of registers (255 with spills), because it keeps
the gathered row addresses and both tiles' layouts live. Here the layout of every step is chosen
by hand:

- a program owns one token, 64 heads (the wgmma M side; fewer heads are padded with masked
  rows) and one split of the list, with 8 warps: two warpgroups;
- the query sits in shared memory once (or, with Q_REGS, in registers as the score wgmma's
  operand); row tiles are gathered by `cp.async` (16 bytes per copy) into a ring of STAGES
  buffers, each tile as two feature halves; the list entries of the tile after next and the
  visibility of the next tile are loaded one iteration ahead, so no copy waits for its
  addresses;
- scores S = Q R^T come from two chained wgmmas per tile (one per feature half; each
  warpgroup computes half of the tile's rows), the probabilities go through shared memory, and
  O += P R is one wgmma per feature half in which each warpgroup owns half of the features (a
  [64, D/4] float32 accumulator per warpgroup and half);
- with HALVES = 2 two programs share a token and head group: both compute the scores, each
  accumulates and stores one feature half, which fills the SMs a decode batch leaves idle
  without a merge;
- the output leaves through the load layout in 16-byte stores.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)
NUM_WARPS: gl.constexpr = gl.constexpr(8)  # two warpgroups


@gluon.jit
def _entries(blocks_ptr, offsets_ptr, valid_ptr, idx, end):
    """Issue the loads of the list entries `idx` (visibility, block, slot; entries past `end`
    read as hidden). Nothing here uses the loaded values, so no thread waits for them until
    `_gather` does, an iteration later."""
    in_list = idx < end
    valid = gl.load(valid_ptr + idx, mask=in_list, other=0)
    block = gl.load(blocks_ptr + idx, mask=in_list, other=0)
    slot = gl.load(offsets_ptr + idx, mask=in_list, other=0)
    return valid, block, slot


@gluon.jit
def _gather(cache_ptr, entries, stride_cb, stride_cs, dims, buf):
    """Asynchronous copy of the rows the `entries` name into `buf`; hidden rows are
    zero-filled."""
    valid, block, slot = entries
    seen = valid != 0
    row_off = gl.where(seen, block.to(gl.int64) * stride_cb + slot.to(gl.int64) * stride_cs, 0)
    ptrs = cache_ptr + gl.expand_dims(row_off, 1) + gl.expand_dims(dims, 0)
    mask = gl.expand_dims(seen, 1) & gl.expand_dims(dims >= 0, 0)
    async_copy.async_copy_global_to_shared(buf, ptrs, mask=mask)


@gluon.jit
def _scores(q0, q1, rows_smem, stage, s_zero):
    """Issue S = Q R^T for the tile in ring slot `stage` (two chained wgmmas, one per feature
    half; two commit groups); wait on the result before use."""
    qk = warpgroup_mma(q0, rows_smem.index(2 * stage).permute((1, 0)), s_zero, use_acc=False,
                       is_async=True)  # fmt: skip
    return warpgroup_mma(q1, rows_smem.index(2 * stage + 1).permute((1, 0)), qk, is_async=True)


@gluon.jit
def _softmax(qk, visible, qk_scale, m_i, l_i):
    """Online-softmax step over one tile's scores (log2 units; hidden columns -inf): the
    probabilities, the factor that rescales what was accumulated, the new max and sum."""
    qk = gl.where(gl.expand_dims(visible != 0, 0), qk * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(qk, axis=1))
    m_safe = gl.where(m_new > float("-inf"), m_new, 0.0)
    p = gl.exp2(qk - gl.expand_dims(m_safe, 1))
    alpha = gl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def gathered_attention_sm90_kernel(
    out_ptr,  # [T, H, D] query dtype
    lse_ptr,  # [T, H] float32
    q_ptr,  # [T, H, D]
    cache_ptr,  # [num_blocks, block_size, D], contiguous features
    blocks_ptr,  # [T, S] int32 or int64
    offsets_ptr,  # [T, S] int32 or int64
    valid_ptr,  # [T, S] uint8
    part_out_ptr,  # SPLIT: [T, H, num_splits, D] float32
    part_lse_ptr,  # SPLIT: [T, H, num_splits] float32, log2 units
    scale,
    num_heads,
    num_rows,
    segment,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_it,
    D: gl.constexpr,
    TILE: gl.constexpr,
    STAGES: gl.constexpr,
    SPLIT: gl.constexpr,
    HALVES: gl.constexpr,  # 2: two programs per token and head group, each with D / 2 outputs
    Q_REGS: gl.constexpr,  # the query as the score wgmma's register operand, not in shared memory
):
    BH: gl.constexpr = 64  # heads per program: the wgmma M side
    C: gl.constexpr = D // 2  # features per chunk: rows and query are held as two chunks
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    # Register layouts: loads (16-byte vectors, a warp covers 2 rows x 128 features), the score
    # tile (warpgroups split its rows: columns of S), each [BH, C] accumulator (warpgroups split
    # the features) and the query as a register operand.
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NUM_WARPS, 1], [1, 0])
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, TILE // 2, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, C // 2, 16]
    )
    q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, load_layout)
    dim_layout: gl.constexpr = gl.SliceLayout(0, load_layout)
    # Shared memory: the ring of row tiles (two chunks per stage), the probabilities and, unless
    # in registers, the query.
    rows_smem = gl.allocate_shared_memory(
        dtype, [STAGES * 2, TILE, C], gl.NVMMASharedLayout.get_default_for([TILE, C], dtype)
    )
    p_smem = gl.allocate_shared_memory(
        dtype, [BH, TILE], gl.NVMMASharedLayout.get_default_for([BH, TILE], dtype)
    )

    head0 = gl.program_id(0) // HALVES * BH
    half = gl.program_id(0) % HALVES
    split = gl.program_id(1)
    t = gl.program_id(2).to(gl.int64)
    begin = split * segment
    end = gl.minimum(begin + segment, num_rows)
    num_tiles = gl.cdiv(end - begin, TILE)
    blocks_ptr += t * stride_it
    offsets_ptr += t * stride_it
    valid_ptr += t * stride_it
    q_ptr += t * stride_qt

    cdims = gl.arange(0, C, layout=dim_layout)
    heads = head0 + gl.arange(0, BH, layout=row_layout)
    if Q_REGS:
        q_heads = head0 + gl.arange(0, BH, layout=gl.SliceLayout(1, q_layout))
        q_dims = gl.arange(0, C, layout=gl.SliceLayout(0, q_layout))
        q_ptrs = q_ptr + gl.expand_dims(q_heads * stride_qh, 1) + gl.expand_dims(q_dims, 0)
        q_mask = gl.expand_dims(q_heads < num_heads, 1) & gl.expand_dims(q_dims >= 0, 0)
        q0 = gl.load(q_ptrs, mask=q_mask, other=0.0)
        q1 = gl.load(q_ptrs + C, mask=q_mask, other=0.0)
    else:
        q_smem = gl.allocate_shared_memory(
            dtype, [2, BH, C], gl.NVMMASharedLayout.get_default_for([BH, C], dtype)
        )
        q_ptrs = q_ptr + gl.expand_dims(heads * stride_qh, 1) + gl.expand_dims(cdims, 0)
        q_mask = gl.expand_dims(heads < num_heads, 1) & gl.expand_dims(cdims >= 0, 0)
        async_copy.async_copy_global_to_shared(q_smem.index(0), q_ptrs, mask=q_mask)
        async_copy.async_copy_global_to_shared(q_smem.index(1), q_ptrs + C, mask=q_mask)
        q0 = q_smem.index(0)
        q1 = q_smem.index(1)
    idx = gl.arange(0, TILE, layout=row_layout)
    # Prologue: tiles 0 .. STAGES - 2 in flight (the query with the first), the entries of tile
    # STAGES - 1 loaded.
    for stage in gl.static_range(STAGES - 1):
        first = _entries(blocks_ptr, offsets_ptr, valid_ptr, begin + stage * TILE + idx, end)
        _gather(cache_ptr, first, stride_cb, stride_cs, cdims, rows_smem.index(2 * stage))
        _gather(cache_ptr, first, stride_cb, stride_cs, C + cdims, rows_smem.index(2 * stage + 1))
        async_copy.commit_group()
    nxt = begin + (STAGES - 1) * TILE + idx
    entries = _entries(blocks_ptr, offsets_ptr, valid_ptr, nxt, end)

    cols = begin + gl.arange(0, TILE, layout=gl.SliceLayout(0, s_layout))
    visible = gl.load(valid_ptr + cols, mask=cols < end, other=0)  # tile 0's columns (uint8)
    qk_scale = scale * LOG2E
    m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BH], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc0 = gl.zeros([BH, C], gl.float32, layout=o_layout)
    acc1 = gl.zeros([BH, C], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BH, TILE], gl.float32, layout=s_layout)
    for i in range(num_tiles):
        # Issue tile i + STAGES - 1 (its entries were loaded last iteration), then load the
        # entries of the tile after it, to be used next iteration.
        ahead = (i + STAGES - 1) % STAGES
        _gather(cache_ptr, entries, stride_cb, stride_cs, cdims, rows_smem.index(2 * ahead))
        _gather(cache_ptr, entries, stride_cb, stride_cs, C + cdims,
                rows_smem.index(2 * ahead + 1))  # fmt: skip
        async_copy.commit_group()
        nxt = begin + (i + STAGES) * TILE + idx
        entries = _entries(blocks_ptr, offsets_ptr, valid_ptr, nxt, end)
        cols += TILE  # the next tile's visibility, used next iteration
        visible_next = gl.load(valid_ptr + cols, mask=cols < end, other=0)  # used raw later
        async_copy.wait_group(STAGES - 1)  # this thread's copies of tile i have landed
        fence_async_shared()  # visible to the wgmma's async proxy
        gl.thread_barrier()  # ... and every other thread's
        cur = i % STAGES
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(_scores(q0, q1, rows_smem, cur, s_zero),))
        p, alpha, m_i, l_i = _softmax(qk, visible, qk_scale, m_i, l_i)
        p_smem.store(p.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        alpha_o = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        if HALVES == 1:
            acc0 = warpgroup_mma(p_smem, rows_smem.index(2 * cur), acc0 * alpha_o,
                                 is_async=True)  # fmt: skip
            acc1 = warpgroup_mma(p_smem, rows_smem.index(2 * cur + 1), acc1 * alpha_o,
                                 is_async=True)  # fmt: skip
            acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
        else:
            acc0 = warpgroup_mma(p_smem, rows_smem.index(2 * cur + half), acc0 * alpha_o,
                                 is_async=True)  # fmt: skip
            acc0 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0,))
        visible = visible_next
        gl.thread_barrier()  # every warpgroup is done with p and this slot before reuse
    async_copy.wait_group(0)

    seen = l_i > 0.0
    norm = gl.where(seen, l_i, 1.0)
    lse2 = gl.where(seen, m_i + gl.log2(norm), float("-inf"))
    norm_o = gl.expand_dims(gl.convert_layout(norm, gl.SliceLayout(1, o_layout)), 1)
    s_heads = head0 + gl.arange(0, BH, layout=gl.SliceLayout(1, s_layout))
    s_mask = s_heads < num_heads
    if HALVES == 1:
        _store_chunk(out_ptr, part_out_ptr, acc0 / norm_o, t, split, heads, cdims, num_heads,
                     stride_ot, stride_oh, D, SPLIT, load_layout)  # fmt: skip
        _store_chunk(out_ptr, part_out_ptr, acc1 / norm_o, t, split, heads, C + cdims, num_heads,
                     stride_ot, stride_oh, D, SPLIT, load_layout)  # fmt: skip
    else:
        _store_chunk(out_ptr, part_out_ptr, acc0 / norm_o, t, split, heads, half * C + cdims,
                     num_heads, stride_ot, stride_oh, D, SPLIT, load_layout)  # fmt: skip
    if half == 0:  # one program of a token's halves stores the log-sum-exp
        if SPLIT:
            part = (t * num_heads + s_heads) * gl.num_programs(1) + split
            gl.store(part_lse_ptr + part, lse2, mask=s_mask)
        else:
            gl.store(lse_ptr + t * num_heads + s_heads, lse2 * LN2, mask=s_mask)


@gluon.jit
def _store_chunk(
    out_ptr, part_out_ptr, out, t, split, heads, dims, num_heads, stride_ot, stride_oh,
    D: gl.constexpr, SPLIT: gl.constexpr, layout: gl.constexpr,
):  # fmt: skip
    """One [heads, chunk] block of the output from the load layout (16-byte vectors along the
    features; the accumulator's own layout writes 4 bytes per thread and row): normalised in
    the query dtype, or as a float32 split partial."""
    o_heads = gl.expand_dims(heads, 1)
    o_dims = gl.expand_dims(dims, 0)
    mask = (o_heads < num_heads) & (o_dims >= 0)
    if SPLIT:
        part = (t * num_heads + o_heads) * gl.num_programs(1) + split
        ptrs = part_out_ptr + part * D + o_dims
        gl.store(ptrs, gl.convert_layout(out, layout), mask=mask)
    else:
        ptrs = out_ptr + t * stride_ot + o_heads * stride_oh + o_dims
        gl.store(ptrs, gl.convert_layout(out.to(out_ptr.dtype.element_ty), layout), mask=mask)
