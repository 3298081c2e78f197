"""Hopper (sm90) version of the gathered shared-KV attention kernel, written in Gluon.

Same contract as `gathered_attention_kernel` (gathered_attention.py), same first arguments: each
query token attends over its own list of cache rows (key = value, one KV head of D features) as
a partial softmax, optionally over one split of the list (SPLIT: the partials are merged by
`merge_partials_kernel`). Two options make it DeepSeek-V4's whole layer attention in one launch
(`v4_ops.gathered_attention_sets`):
- TWO_LISTS: after list A's tiles it walks a second list B, whose rows live in another cache
  (its offset from `cache_ptr` in elements, its own strides): the list, cache offset and
  strides of each tile are chosen per tile, so both lists' rows go through the same ring and
  one online softmax;
- SINKS: one more logit per head without a value joins the softmax's denominator, and the
  output is final (no log-sum-exp is stored);
- B_LENGTHS: list B stops at each token's length (its rows past it are hidden), so a list
  padded to a fixed size (a CUDA-graph step's `max_model_len` entries) costs only the tiles
  the token sees.

Why a second kernel: at DeepSeek-V4's decode shape (64 heads of 512) the Triton kernel cannot use
the Hopper tensor-core instructions well. With 32 heads per program the compiler falls back to
mma.sync, which streams the query and every row tile from shared memory into registers per
warp; with 64 heads it uses wgmma but runs out of registers (255 with spills), because it keeps
the gathered row addresses and both tiles' layouts live. Here the layout of every step is chosen
by hand:

- a program owns one token, 64 heads (the wgmma M side; fewer heads are padded with masked
  rows) and one split of the list, with 8 warps: two warpgroups;
- the query sits in shared memory once; row tiles are gathered whole by `cp.async` (16 bytes per
  copy) into a ring of STAGES buffers; the list entries of the tile after next and the
  visibility of the next tile are loaded one iteration ahead, so no copy waits for its
  addresses, and the prologue issues every load it will wait for before its first copy;
- scores S = Q R^T are one wgmma per tile (each warpgroup computes half of the tile's rows),
  the probabilities go through shared memory, and O += P R is one wgmma in which each
  warpgroup owns half of the output features;
- the softmax's row sums are kept per score element and summed once at the end: only the row
  max crosses the warpgroups each tile;
- with HALVES = 2 two programs share a token and head group: both compute the scores, each
  accumulates and stores one feature half, which fills the SMs a decode batch leaves idle
  without a merge. Each program keeps the features rotated by its half in shared memory, so
  its half is always the first columns of a row tile;
- the output leaves through the load layout in 16-byte stores.

Six barriers per tile remain: four the compiler places (before the ring copy, after the copy
wait, two in the max), and two ordering the copies and the probabilities for the wgmma. Splitting
the features between the warpgroups instead (each scores its half and the partial scores are
exchanged through shared memory, no probabilities in shared memory) was measured slower
(benchmarks/README.md).
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
def _source(j, tiles_a, list_a, list_b, TILE: gl.constexpr, TWO_LISTS: gl.constexpr):
    """Where tile j of the lists' concatenation (list A's tiles, then list B's) reads: its
    list's entry pointers, the tile's first entry, the list's end and its rows' addressing. A
    list is `(blocks, offsets, valid, start, end, cache offset, block stride, slot stride)`:
    entry pointers of this token, the first entry and the end of the part it walks (a split's
    segment for list A), and the element offset of its cache from `cache_ptr` with the cache's
    strides."""
    if TWO_LISTS:
        in_a = j < tiles_a
        first = gl.where(in_a, list_a[3] + j * TILE, (j - tiles_a) * TILE)
        return (
            gl.where(in_a, list_a[0], list_b[0]),
            gl.where(in_a, list_a[1], list_b[1]),
            gl.where(in_a, list_a[2], list_b[2]),
            first,
            gl.where(in_a, list_a[4], list_b[4]),
            gl.where(in_a, list_a[5], list_b[5]),
            gl.where(in_a, list_a[6], list_b[6]),
            gl.where(in_a, list_a[7], list_b[7]),
        )
    else:
        return (list_a[0], list_a[1], list_a[2], list_a[3] + j * TILE, list_a[4], list_a[5],
                list_a[6], list_a[7])  # fmt: skip


@gluon.jit
def _entries(src, idx):
    """Issue the loads of a tile's list entries (visibility, block, slot; entries past the
    list's end read as hidden) and pass on its rows' addressing. Nothing here uses the loaded
    values, so no thread waits for them until `_gather` does, an iteration later."""
    blocks_ptr, offsets_ptr, valid_ptr, first, end, cache_off, stride_cb, stride_cs = src
    entry = first + idx
    in_list = entry < end
    valid = gl.load(valid_ptr + entry, mask=in_list, other=0)
    block = gl.load(blocks_ptr + entry, mask=in_list, other=0)
    slot = gl.load(offsets_ptr + entry, mask=in_list, other=0)
    return valid, block, slot, cache_off, stride_cb, stride_cs


@gluon.jit
def _visible(src, cols):
    """A tile's visibility (uint8) in the score columns' layout."""
    entry = src[3] + cols
    return gl.load(src[2] + entry, mask=entry < src[4], other=0)


@gluon.jit
def _gather(cache_ptr, entries, dims, buf):
    """Asynchronous copy of the rows the `entries` name into `buf`; hidden rows are
    zero-filled."""
    valid, block, slot, cache_off, stride_cb, stride_cs = entries
    seen = valid != 0
    row = cache_off + block.to(gl.int64) * stride_cb + slot.to(gl.int64) * stride_cs
    # Rows start on 16-byte boundaries (the launcher checks every cache): the compiler cannot
    # see it through the per-tile choice of list, and its 16-byte copies need it.
    row = gl.multiple_of(gl.where(seen, row, 0), 8)
    ptrs = cache_ptr + gl.expand_dims(row, 1) + gl.expand_dims(dims, 0)
    mask = gl.expand_dims(seen, 1) & gl.expand_dims(dims >= 0, 0)
    async_copy.async_copy_global_to_shared(buf, ptrs, mask=mask)


@gluon.jit
def _softmax(qk, visible, qk_scale, m_i, l_acc):
    """Online-softmax step over one tile's raw scores (hidden columns -inf): the probabilities
    `exp2((s - m) * qk_scale)` (one fused multiply-add per score), the factor that rescales
    what was accumulated, the new running max (raw score units) and the rescaled per-element
    sums. The row sums stay per element until the end: summing a row crosses the two
    warpgroups (shared memory and barriers), which the max alone now does once per tile."""
    qk = gl.where(gl.expand_dims(visible != 0, 0), qk, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(qk, axis=1))
    m_safe = gl.where(m_new > float("-inf"), m_new, 0.0) * qk_scale
    p = gl.exp2(qk * qk_scale - gl.expand_dims(m_safe, 1))
    alpha = gl.exp2(m_i * qk_scale - m_safe)
    return p, alpha, m_new, l_acc * gl.expand_dims(alpha, 1) + p


@gluon.jit
def gathered_attention_sm90_kernel(
    out_ptr,  # [T, H, D] query dtype
    lse_ptr,  # [T, H] float32 (not written with SINKS)
    q_ptr,  # [T, H, D]
    cache_ptr,  # list A's cache [num_blocks, block_size, D], contiguous features
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
    b_cache_off,  # TWO_LISTS: list B's cache, in elements from cache_ptr (int64)
    b_blocks_ptr,  # TWO_LISTS: list B, [T, S_B], the dtype of list A's
    b_offsets_ptr,
    b_valid_ptr,
    b_rows,  # S_B
    b_stride_cb,
    b_stride_cs,
    b_stride_it,
    sinks_ptr,  # SINKS: [H], one logit per head (natural log units)
    b_lengths_ptr,  # B_LENGTHS: [T], list B's rows past which every row is hidden
    D: gl.constexpr,
    TILE: gl.constexpr,
    STAGES: gl.constexpr,
    SPLIT: gl.constexpr,
    HALVES: gl.constexpr,  # 2: two programs per token and head group, each with D / 2 outputs
    TWO_LISTS: gl.constexpr = False,  # one softmax over list A, then list B (no SPLIT)
    SINKS: gl.constexpr = False,  # the sinks join the softmax; the output is final (no SPLIT)
    B_LENGTHS: gl.constexpr = False,  # TWO_LISTS: stop list B at each token's length
):
    BH: gl.constexpr = 64  # heads per program: the wgmma M side
    OUT: gl.constexpr = D // HALVES  # output features of this program
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    # Register layouts: loads (16-byte vectors, a warp covers 2 rows x 128 features), the score
    # tile (warpgroups split its rows: columns of S) and the accumulator (warpgroups split the
    # features).
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NUM_WARPS, 1], [1, 0])
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, TILE // 2, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, OUT // 2, 16]
    )
    row_layout: gl.constexpr = gl.SliceLayout(1, load_layout)
    dim_layout: gl.constexpr = gl.SliceLayout(0, load_layout)
    # Shared memory: the query, the ring of whole row tiles and the probabilities. One
    # allocation per operand and one copy per tile: the compiler orders every copy into an
    # allocation behind a barrier.
    q_smem = gl.allocate_shared_memory(
        dtype, [BH, D], gl.NVMMASharedLayout.get_default_for([BH, D], dtype)
    )
    rows_smem = gl.allocate_shared_memory(
        dtype, [STAGES, TILE, D], gl.NVMMASharedLayout.get_default_for([TILE, D], dtype)
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
    tiles_a = gl.cdiv(end - begin, TILE)
    list_a = (blocks_ptr + t * stride_it, offsets_ptr + t * stride_it, valid_ptr + t * stride_it,
              begin, end, b_cache_off * 0, stride_cb, stride_cs)  # fmt: skip
    list_b = list_a
    num_tiles = tiles_a
    if TWO_LISTS:
        b_end = b_rows
        if B_LENGTHS:  # the tiles past the token's last visible row are not walked
            b_end = gl.minimum(b_rows, gl.load(b_lengths_ptr + t).to(gl.int32))
        list_b = (b_blocks_ptr + t * b_stride_it, b_offsets_ptr + t * b_stride_it,
                  b_valid_ptr + t * b_stride_it, begin * 0, b_end, b_cache_off, b_stride_cb,
                  b_stride_cs)  # fmt: skip
        num_tiles = tiles_a + gl.cdiv(b_end, TILE)
    q_ptr += t * stride_qt

    # Shared-memory column c holds feature (c + half * OUT) % D of the query and of every row:
    # the scores do not change, and this program's output features are the first OUT columns.
    dims = (gl.arange(0, D, layout=dim_layout) + half * OUT) % D
    heads = head0 + gl.arange(0, BH, layout=row_layout)
    idx = gl.arange(0, TILE, layout=row_layout)
    # Prologue. Every load that a later step waits for is issued first (tile 0's and tile
    # STAGES - 1's entries, tile 0's visibility), then the query and tiles 0 .. STAGES - 2.
    first = _entries(_source(0, tiles_a, list_a, list_b, TILE, TWO_LISTS), idx)
    entries = _entries(_source(STAGES - 1, tiles_a, list_a, list_b, TILE, TWO_LISTS), idx)
    cols = gl.arange(0, TILE, layout=gl.SliceLayout(0, s_layout))
    visible = _visible(_source(0, tiles_a, list_a, list_b, TILE, TWO_LISTS), cols)
    q_ptrs = q_ptr + gl.expand_dims(heads * stride_qh, 1) + gl.expand_dims(dims, 0)
    q_mask = gl.expand_dims(heads < num_heads, 1) & gl.expand_dims(dims >= 0, 0)
    async_copy.async_copy_global_to_shared(q_smem, q_ptrs, mask=q_mask)
    _gather(cache_ptr, first, dims, rows_smem.index(0))
    async_copy.commit_group()
    for stage in gl.static_range(1, STAGES - 1):
        more = _entries(_source(stage, tiles_a, list_a, list_b, TILE, TWO_LISTS), idx)
        _gather(cache_ptr, more, dims, rows_smem.index(stage))
        async_copy.commit_group()

    qk_scale = scale * LOG2E
    m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_acc = gl.zeros([BH, TILE], gl.float32, layout=s_layout)
    acc = gl.zeros([BH, OUT], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BH, TILE], gl.float32, layout=s_layout)
    for i in range(num_tiles):
        # Issue tile i + STAGES - 1 (its entries were loaded last iteration), then load the
        # entries of the tile after it, to be used next iteration.
        _gather(cache_ptr, entries, dims, rows_smem.index((i + STAGES - 1) % STAGES))
        async_copy.commit_group()
        entries = _entries(_source(i + STAGES, tiles_a, list_a, list_b, TILE, TWO_LISTS), idx)
        # the next tile's visibility, used next iteration
        visible_next = _visible(_source(i + 1, tiles_a, list_a, list_b, TILE, TWO_LISTS), cols)
        async_copy.wait_group(STAGES - 1)  # this thread's copies of tile i have landed
        fence_async_shared()  # visible to the wgmma's async proxy
        gl.thread_barrier()  # ... and every other thread's
        rows = rows_smem.index(i % STAGES)
        qk = warpgroup_mma(q_smem, rows.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
        p, alpha, m_i, l_acc = _softmax(qk, visible, qk_scale, m_i, l_acc)
        p_smem.store(p.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        alpha_o = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        values = rows if HALVES == 1 else rows.slice(0, OUT, dim=1)
        acc = warpgroup_mma(p_smem, values, acc * alpha_o, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        visible = visible_next
        # No barrier here: the compiler places one before the next iteration's copy into the
        # ring (it orders every write into an allocation after the reads before it), which
        # also keeps the next p from overwriting this one early.
    async_copy.wait_group(0)

    l_i = gl.sum(l_acc, axis=1)
    s_heads = head0 + gl.arange(0, BH, layout=gl.SliceLayout(1, s_layout))
    s_mask = s_heads < num_heads
    seen = l_i > 0.0
    if SINKS:
        # The sink is one more logit without a value: its mass joins the denominator only.
        # With no visible row the output is 0 (acc is), measured against the sink itself.
        sink2 = gl.load(sinks_ptr + s_heads, mask=s_mask, other=0.0).to(gl.float32) * LOG2E
        top = gl.where(m_i > float("-inf"), m_i * qk_scale, sink2)
        norm = l_i + gl.exp2(sink2 - top)
    else:
        norm = gl.where(seen, l_i, 1.0)
    lse2 = gl.where(seen, m_i * qk_scale + gl.log2(norm), float("-inf"))
    norm_o = gl.expand_dims(gl.convert_layout(norm, gl.SliceLayout(1, o_layout)), 1)
    out_dims = half * OUT + gl.arange(0, OUT, layout=dim_layout)
    _store_chunk(out_ptr, part_out_ptr, acc / norm_o, t, split, heads, out_dims, num_heads,
                 stride_ot, stride_oh, D, SPLIT, load_layout)  # fmt: skip
    if not SINKS:  # noqa: SIM102 (a constexpr test, then a runtime one: Gluon cannot mix them)
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
