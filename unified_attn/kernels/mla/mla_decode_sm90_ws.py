"""Warp-specialized Hopper (sm90) MLA decode kernel, written in Gluon.

Same contract and arguments as `mla_attention_sm90_kernel` (mla_attention_sm90.py: decode, one
query token per request at position `seq_len - 1`, split-KV partials merged by
`merge_partials_kernel`), for caches whose pages hold a multiple of 64 keys: a 64-key tile is
then one page's rows, which one TMA copy brings.

Why a second Hopper kernel: in the lockstep kernel both warpgroups work on every tile together,
so each computes half of every score tile (its scores re-read the whole query from shared
memory), and the tensor cores idle while both run the softmax. Here (as FlashMLA does on sm90)
the two warpgroups are separate partitions that own alternate tiles:

- a program owns one token, 64 heads and one segment of its keys, with two warpgroups: tile
  2i (in ring stage 0) is warpgroup 0's, tile 2i + 1 (stage 1) warpgroup 1's. Each computes the
  whole score tile of its own tiles, S = q_nope c^T + q_pe k_pe^T (64 x 64, the rope part of the
  query in registers), runs the softmax step and publishes its probabilities, new row max and
  rescale factor in shared memory;
- warpgroup w owns half w of the L output features: it accumulates O_w += P c_w for every tile,
  its own probabilities and the other's, in tile order (the row maxima form one chain: each
  softmax starts from the max the previous tile published);
- each tile's latent row is loaded as two halves, by TMA, with one mbarrier per half and stage.
  Warpgroup w refills half w of a stage as soon as its own product over that stage is done (the
  scores over it are done by then), so the half the other warpgroup still reads is not waited
  for, and the owner of a tile issues its score products half by half as each lands, its own
  half first;
- each warpgroup issues its next scores before it waits for the other's probabilities, so one
  warpgroup's softmax runs while the other's products use the tensor cores;
- the last tile of a segment may end inside its page: its rows past the segment hold whatever
  the page holds (possibly NaN, and 0 * NaN poisons the product), so each warpgroup zeroes them
  in its half before its product.

Shared memory at L = 512, R = 64: the query (64 KiB), two stages of key halves (128 KiB) and
rope features (16 KiB), the probabilities of both stages (16 KiB) and the statistics.

Compiler notes (Triton 3.6), measured and kept as workarounds:
- stage indices are constants (tiles go in pairs), and the shared-memory views a loop uses take
  an index offset `zero * i` (`zero` is a kernel argument, always 0): with constant views the
  compiler keeps every wgmma descriptor of the loop in registers (500 bytes of spills); with
  indices that follow the tile parity through a branch it reused the score products'
  descriptor base for the value products (wrong values);
- both partitions are one function specialised by `w`.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from unified_attn.kernels.mla.mla_attention_sm90 import segment_of

BH: gl.constexpr = gl.constexpr(64)  # heads per program: the wgmma M side
TILE: gl.constexpr = gl.constexpr(64)  # keys per tile
# Barriers: ready[2 * half + stage] (TMA), published[stage], the end of the loop, the query.
READY: gl.constexpr = gl.constexpr(0)
PUBLISHED: gl.constexpr = gl.constexpr(4)
END: gl.constexpr = gl.constexpr(6)
QUERY: gl.constexpr = gl.constexpr(7)


@gluon.jit
def _load_half(w: gl.constexpr, desc, pe_desc, k, k_pe, bars, table_row, rows_per_block, seg_lo,
               j, s: gl.constexpr, PAGE: gl.constexpr, HALF: gl.constexpr,
               R: gl.constexpr):  # fmt: skip
    """TMA of half w of tile j's latent features into stage s (half 1 brings the rope features
    too); ready[2 * w + s] completes when they land."""
    start = seg_lo + j * TILE
    block = gl.load(table_row + start // PAGE)
    row = block * rows_per_block + start % PAGE
    bar = bars.index(READY + 2 * w + s)
    if w == 0:
        mbarrier.expect(bar, TILE * HALF * 2)
    else:
        mbarrier.expect(bar, TILE * (HALF + R) * 2)
        tma.async_copy_global_to_shared(pe_desc, [row, 0], bar, k_pe.index(s))
    tma.async_copy_global_to_shared(desc, [row, w * HALF], bar, k.index(2 * w + s))


@gluon.jit
def _zero_tail(v, valid, HALF: gl.constexpr):
    """Zero rows `valid..` of the value half `v [TILE, HALF]`, 64 columns at a time."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = gl.expand_dims(gl.arange(0, TILE, layout=gl.SliceLayout(1, layout)), 1)
    for c in gl.static_range(HALF // 64):
        chunk = v.slice(c * 64, 64, dim=1)
        x = chunk.load(layout)
        chunk.store(gl.where(rows < valid, x, gl.zeros_like(x)))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _issue_scores(q, k, k_pe, qpe, bars, s: gl.constexpr, phase, d, s_layout: gl.constexpr):
    """Issue stage s's scores (three asynchronous wgmma), each half once it has landed: first
    half s, which the owner of stage s refilled itself."""
    zero = gl.zeros([BH, TILE], gl.float32, layout=s_layout)
    mbarrier.wait(bars.index(READY + 3 * s), phase)
    qk = warpgroup_mma(q.index(s), k.index(3 * s + d).permute((1, 0)), zero, use_acc=False,
                       is_async=True)  # fmt: skip
    mbarrier.wait(bars.index(READY + 2 - s), phase)
    qk = warpgroup_mma(q.index(1 - s), k.index(2 - s + d).permute((1, 0)), qk, is_async=True)
    return warpgroup_mma(qpe, k_pe.index(s + d).permute((1, 0)), qk, is_async=True)


@gluon.jit
def _softmax(qk, m_prev, l_i, valid, qk_scale, s_layout: gl.constexpr):
    """One online-softmax step over a tile's raw scores (keys at or past `valid` hidden):
    probabilities, new row max (scaled log2 units), row sums and the old values' factor."""
    cols = gl.arange(0, TILE, layout=gl.SliceLayout(0, s_layout))
    s2 = gl.where(gl.expand_dims(cols < valid, 0), qk * qk_scale, float("-inf"))
    m_new = gl.maximum(m_prev, gl.max(s2, axis=1))
    p = gl.exp2(s2 - gl.expand_dims(m_new, 1))
    scale = gl.exp2(m_prev - m_new)
    return p, m_new, l_i * scale + gl.sum(p, axis=1), scale


@gluon.jit
def _publish(p, m_new, scale, p_smem, stats, bars, s: gl.constexpr):
    """Stage s's probabilities, new max and rescale factor, for the other warpgroup."""
    p_smem.index(s).store(p.to(p_smem.dtype))
    stats.index(2 * s).store(m_new)
    stats.index(2 * s + 1).store(scale)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(bars.index(PUBLISHED + s), count=1)


@gluon.jit
def _take(stats, bars, w: gl.constexpr, s: gl.constexpr, phase, l_i, row_s: gl.constexpr,
          row_o: gl.constexpr):  # fmt: skip
    """The other warpgroup's tile in stage s, once published and this half has landed: its row
    max, the row sums rescaled and the accumulator's factor."""
    mbarrier.wait(bars.index(PUBLISHED + s), phase)
    mbarrier.wait(bars.index(READY + 2 * w + s), phase)
    m_prev = stats.index(2 * s).load(row_s)
    l_i = l_i * stats.index(2 * s + 1).load(row_s)
    return m_prev, l_i, gl.expand_dims(stats.index(2 * s + 1).load(row_o), 1)


@gluon.jit
def _warpgroup(w: gl.constexpr, desc, pe_desc, q, k, k_pe, p_smem, stats, lsum, bars, q_ptr,
               out_ptr, part_acc_ptr, part_lse_ptr, seq_lens_ptr, block_table_ptr, num_heads,
               segment_len, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
               rows_per_block, zero, L: gl.constexpr, R: gl.constexpr, PAGE: gl.constexpr,
               SPLIT: gl.constexpr, QUERY_LEN: gl.constexpr):  # fmt: skip
    """Warpgroup w: the scores of the tiles in stage w, and output features
    `[w * L / 2, (w + 1) * L / 2)` of every tile."""
    HALF: gl.constexpr = L // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TILE, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16]
    )
    qa_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    t, req, head0, segment, seg_lo, seg_hi, num_tiles = segment_of(
        seq_lens_ptr, segment_len, BH, TILE, QUERY_LEN
    )
    q_ptr += t * stride_qt
    table_row = block_table_ptr + req * stride_bt

    # Half w of the query's latent part, then both halves are waited for.
    ql: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    q_heads = head0 + gl.arange(0, BH, layout=gl.SliceLayout(1, ql))
    q_dims = w * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, ql))
    async_copy.async_copy_global_to_shared(
        q.index(w), q_ptr + gl.expand_dims(q_heads * stride_qh, 1) + gl.expand_dims(q_dims, 0),
        mask=gl.expand_dims(q_heads < num_heads, 1) & gl.expand_dims(q_dims >= 0, 0),
    )  # fmt: skip
    async_copy.commit_group()
    async_copy.wait_group(0)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(bars.index(QUERY), count=1)
    # The rope part of the query, in registers as the A operand of its score product.
    pe_heads = head0 + gl.arange(0, BH, layout=gl.SliceLayout(1, qa_layout))
    pe_dims = gl.arange(0, R, layout=gl.SliceLayout(0, qa_layout))
    qpe = gl.load(q_ptr + L + gl.expand_dims(pe_heads * stride_qh, 1) + gl.expand_dims(pe_dims, 0),
                  mask=gl.expand_dims(pe_heads < num_heads, 1) & gl.expand_dims(pe_dims >= 0, 0),
                  other=0.0)  # fmt: skip
    mbarrier.wait(bars.index(QUERY), 0)

    m_prev = gl.full([BH], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BH], gl.float32, layout=row_s)
    acc = gl.zeros([BH, HALF], gl.float32, layout=o_layout)
    num_pairs = num_tiles // 2
    if w == 0:
        qk = warpgroup_mma_init(gl.zeros([BH, TILE], gl.float32, layout=s_layout))
        if num_tiles > 0:
            qk = _issue_scores(q, k, k_pe, qpe, bars, 0, 0, zero, s_layout)
        for i in range(num_pairs):
            ph = i & 1
            d = zero * i
            first = seg_hi - seg_lo - 2 * i * TILE  # keys left from tile 2i on
            # Own tile 2i: softmax, publish, this half of its product, refill this half.
            scores = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
            p, m_prev, l_i, scale = _softmax(scores, m_prev, l_i, first, qk_scale, s_layout)
            _publish(p, m_prev, scale, p_smem, stats, bars, 0)
            scale_o = gl.expand_dims(gl.convert_layout(scale, row_o), 1)
            acc = warpgroup_mma(p_smem.index(d), k.index(d), acc * scale_o, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            gl.thread_barrier()
            if 2 * i + 2 < num_tiles:
                _load_half(0, desc, pe_desc, k, k_pe, bars, table_row, rows_per_block,
                           seg_lo, 2 * i + 2, 0, PAGE, HALF, R)  # fmt: skip
            # The other's tile 2i + 1, then the scores of the next pair's tile are issued.
            m_prev, l_i, scale_o = _take(stats, bars, 0, 1, ph, l_i, row_s, row_o)
            if first - TILE < TILE:
                _zero_tail(k.index(1 + d), first - TILE, HALF)
            acc = warpgroup_mma(p_smem.index(1 + d), k.index(1 + d), acc * scale_o,
                                is_async=True)  # fmt: skip
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            gl.thread_barrier()
            if 2 * i + 3 < num_tiles:  # refill first: the other warpgroup waits for it
                _load_half(0, desc, pe_desc, k, k_pe, bars, table_row, rows_per_block,
                           seg_lo, 2 * i + 3, 1, PAGE, HALF, R)  # fmt: skip
            if 2 * i + 2 < num_tiles:
                qk = _issue_scores(q, k, k_pe, qpe, bars, 0, ph ^ 1, d, s_layout)
        if num_tiles % 2 == 1:  # the last tile, alone in stage 0
            last = seg_hi - seg_lo - (num_tiles - 1) * TILE
            scores = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
            p, m_prev, l_i, scale = _softmax(scores, m_prev, l_i, last, qk_scale, s_layout)
            _publish(p, m_prev, scale, p_smem, stats, bars, 0)
            if last < TILE:
                _zero_tail(k.index(0), last, HALF)
            scale_o = gl.expand_dims(gl.convert_layout(scale, row_o), 1)
            acc = warpgroup_mma(p_smem.index(0), k.index(0), acc * scale_o, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    else:
        for i in range(num_pairs):
            ph = i & 1
            d = zero * i
            first = seg_hi - seg_lo - 2 * i * TILE
            # Own tile 2i + 1's scores first; the other's tile 2i while they run.
            qk = _issue_scores(q, k, k_pe, qpe, bars, 1, ph, d, s_layout)
            m_prev, l_i, scale_o = _take(stats, bars, 1, 0, ph, l_i, row_s, row_o)
            if first < TILE:
                _zero_tail(k.index(2 + d), first, HALF)
            acc = warpgroup_mma(p_smem.index(d), k.index(2 + d), acc * scale_o, is_async=True)
            scores = warpgroup_mma_wait(num_outstanding=1, deps=(qk,))
            p, m_prev, l_i, scale = _softmax(scores, m_prev, l_i, first - TILE, qk_scale,
                                             s_layout)  # fmt: skip
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            gl.thread_barrier()
            if 2 * i + 2 < num_tiles:  # stage 0's half is free: refill it before publishing
                _load_half(1, desc, pe_desc, k, k_pe, bars, table_row, rows_per_block,
                           seg_lo, 2 * i + 2, 0, PAGE, HALF, R)  # fmt: skip
            _publish(p, m_prev, scale, p_smem, stats, bars, 1)
            if first - TILE < TILE:
                _zero_tail(k.index(3 + d), first - TILE, HALF)
            scale_o = gl.expand_dims(gl.convert_layout(scale, row_o), 1)
            acc = warpgroup_mma(p_smem.index(1 + d), k.index(3 + d), acc * scale_o,
                                is_async=True)  # fmt: skip
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            gl.thread_barrier()
            if 2 * i + 3 < num_tiles:
                _load_half(1, desc, pe_desc, k, k_pe, bars, table_row, rows_per_block,
                           seg_lo, 2 * i + 3, 1, PAGE, HALF, R)  # fmt: skip
        if num_tiles % 2 == 1:
            last = seg_hi - seg_lo - (num_tiles - 1) * TILE
            m_prev, l_i, scale_o = _take(stats, bars, 1, 0, num_pairs & 1, l_i, row_s, row_o)
            if last < TILE:
                _zero_tail(k.index(2), last, HALF)
            acc = warpgroup_mma(p_smem.index(0), k.index(2), acc * scale_o, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    # Each warpgroup summed the probabilities of its own tiles: add the other's.
    lsum.index(w).store(l_i)
    gl.thread_barrier()
    mbarrier.arrive(bars.index(END), count=1)
    mbarrier.wait(bars.index(END), 0)
    l_tot = l_i + lsum.index(1 - w).load(row_s)
    seen = l_tot > 0.0
    norm = gl.where(seen, l_tot, 1.0)
    out = acc / gl.expand_dims(gl.convert_layout(norm, row_o), 1)
    heads = gl.expand_dims(head0 + gl.arange(0, BH, layout=row_o), 1)
    dims = gl.expand_dims(w * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout)), 0)
    mask = (heads < num_heads) & (dims >= 0)
    if SPLIT:
        part = (t * num_heads + heads) * gl.num_programs(1) + segment
        gl.store(part_acc_ptr + part * L + dims, out, mask=mask)
        if w == 0:
            s_heads = head0 + gl.arange(0, BH, layout=row_s)
            lse2 = gl.where(seen, m_prev + gl.log2(norm), float("-inf"))
            part = (t * num_heads + s_heads) * gl.num_programs(1) + segment
            gl.store(part_lse_ptr + part, lse2, mask=s_heads < num_heads)
    else:
        out_ptrs = out_ptr + t * stride_ot + heads * stride_oh + dims
        gl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def mla_decode_sm90_ws_kernel(
    out_ptr,  # [T, H, L]
    q_ptr,  # [T, H, L + R]
    block_table_ptr,  # [T, max_blocks] int32 (one request per token)
    seq_lens_ptr,  # [T] int32
    part_acc_ptr,  # [T, H, num_segments, L] float32 (SPLIT only)
    part_lse_ptr,  # [T, H, num_segments] float32, log2 units (SPLIT only)
    qk_scale,  # softmax scale * log2(e)
    num_heads,
    segment_len,  # keys per segment (SPLIT; a multiple of 64)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    rows_per_block,  # cache rows from one block to the next (its stride over the row stride)
    zero,  # always 0 (see the module's compiler notes)
    desc,  # the cache's latent part as [rows, L], blocks [64, L / 2]
    pe_desc,  # its rope part as [rows, R], blocks [64, R]
    L: gl.constexpr,
    R: gl.constexpr,
    PAGE: gl.constexpr,
    SPLIT: gl.constexpr,
    QUERY_LEN: gl.constexpr,  # query tokens of every request (1: decode)
):
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    HALF: gl.constexpr = L // 2
    q = gl.allocate_shared_memory(
        dtype, [2, BH, HALF], gl.NVMMASharedLayout.get_default_for([BH, HALF], dtype)
    )
    k = gl.allocate_shared_memory(dtype, [4, TILE, HALF], desc.layout)  # 2 * half + stage
    k_pe = gl.allocate_shared_memory(dtype, [2, TILE, R], pe_desc.layout)
    p_smem = gl.allocate_shared_memory(
        dtype, [2, BH, TILE], gl.NVMMASharedLayout.get_default_for([BH, TILE], dtype)
    )
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    stats = gl.allocate_shared_memory(gl.float32, [4, BH], flat)  # max, factor of each stage
    lsum = gl.allocate_shared_memory(gl.float32, [2, BH], flat)
    bars = gl.allocate_shared_memory(gl.int64, [8, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(6):
        mbarrier.init(bars.index(i), count=1)
    mbarrier.init(bars.index(END), count=2)
    mbarrier.init(bars.index(QUERY), count=2)

    # The first two tiles, by the default warps before the partitions start.
    _, req, _, _, seg_lo, _, num_tiles = segment_of(seq_lens_ptr, segment_len, BH, TILE,
                                                     QUERY_LEN)  # fmt: skip
    table_row = block_table_ptr + req * stride_bt
    for j in gl.static_range(2):
        if j < num_tiles:
            for w in gl.static_range(2):
                _load_half(w, desc, pe_desc, k, k_pe, bars, table_row, rows_per_block, seg_lo,
                           j, j, PAGE, HALF, R)  # fmt: skip
    gl.warp_specialize(
        [
            (_warpgroup, (0, desc, pe_desc, q, k, k_pe, p_smem, stats, lsum, bars, q_ptr,
                          out_ptr, part_acc_ptr, part_lse_ptr, seq_lens_ptr, block_table_ptr,
                          num_heads, segment_len, qk_scale, stride_qt, stride_qh, stride_ot,
                          stride_oh, stride_bt, rows_per_block, zero, L, R, PAGE, SPLIT,
                          QUERY_LEN)),
            (_warpgroup, (1, desc, pe_desc, q, k, k_pe, p_smem, stats, lsum, bars, q_ptr,
                          out_ptr, part_acc_ptr, part_lse_ptr, seq_lens_ptr, block_table_ptr,
                          num_heads, segment_len, qk_scale, stride_qt, stride_qh, stride_ot,
                          stride_oh, stride_bt, rows_per_block, zero, L, R, PAGE, SPLIT,
                          QUERY_LEN)),
        ],
        [4],
        [256],
    )  # fmt: skip
