"""Hopper (sm90) version of the weight-absorbed MLA decode kernel, written in Gluon.

Same contract as `mla_attention_kernel` (mla_attention.py) for one case, decode: every request
has one query token, at position `seq_len - 1`, which sees the request's keys `[0, seq_len)`.
Same arguments, outputs and split-KV partials (merged by `merge_partials_kernel`).

Why a second kernel: with all 128 heads of DeepSeek-V3 on one GPU the decode attention is
compute-bound (241 FLOPs per latent byte), and the Triton kernel reaches about 38% of the
measured bf16 matmul rate there: the compiler keeps the query tile and both operand layouts of
each dot live (255 registers with spills) and cannot keep the copies of the next tile in flight
while the tensor cores work. Here every step's layout is chosen by hand, as in the Hopper
gathered-attention kernel (gathered_attention_sm90.py), whose softmax and output helpers it
shares:

- a program owns one token, 64 heads (the wgmma M side; a last group of fewer heads is padded
  with masked rows) and one segment of its keys, with 8 warps: two warpgroups;
- the query sits in shared memory once, as its latent part `[64, L]` and its rope part
  `[64, R]`; key tiles of TILE keys are copied whole by `cp.async` (16 bytes per copy, each key
  row found through the block table, any page size) into a ring of STAGES buffers, the block
  table entries of the next tile loaded an iteration ahead;
- scores S = q_nope c^T + q_pe k_pe^T are two chained wgmma instructions (each warpgroup
  computes half of the tile's keys), the probabilities go through shared memory, and
  O += P c is one wgmma in which each warpgroup owns half of the L output features;
- the softmax's row sums are kept per score element and summed once at the end: only the row
  max crosses the warpgroups each tile.

Shared memory at L = 512, R = 64, TILE = 64, STAGES = 2: 72 KiB of query, 2 x 72 KiB of keys
and 8 KiB of probabilities: 224 KiB of the 227 an sm90 program may use.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from unified_attn.kernels.sparse.gathered_attention_sm90 import _softmax, _store_chunk

LOG2E = gl.constexpr(1.4426950408889634)
NUM_WARPS: gl.constexpr = gl.constexpr(8)  # two warpgroups


@gluon.jit
def segment_of(seq_lens_ptr, segment_len, BH: gl.constexpr, TILE: gl.constexpr,
               QUERY_LEN: gl.constexpr):  # fmt: skip
    """A program's query token t (grid: head groups, segments, tokens), its request (QUERY_LEN
    tokens each: token j of request r is its query `r * QUERY_LEN + j` and sees the request's
    keys `[0, seq_len - QUERY_LEN + j + 1)`), first head, segment, the segment's keys `[seg_lo,
    seg_hi)` and its tiles; the last segment takes every key left."""
    head0 = gl.program_id(0) * BH
    segment = gl.program_id(1)
    t = gl.program_id(2).to(gl.int64)
    req = t // QUERY_LEN
    seq_len = gl.load(seq_lens_ptr + req) - (QUERY_LEN - 1 - (t % QUERY_LEN)).to(gl.int32)
    seg_lo = segment * segment_len
    seg_hi = seq_len
    if segment < gl.num_programs(1) - 1:
        seg_hi = gl.minimum(seq_len, seg_lo + segment_len)
    num_tiles = gl.cdiv(gl.maximum(seg_hi - seg_lo, 0), TILE)
    return t, req, head0, segment, seg_lo, seg_hi, num_tiles


@gluon.jit
def _key_rows(table_row, keys, end, stride_cb, stride_cs, PAGE: gl.constexpr):
    """Element offsets of the cache rows of `keys` (0 for keys at or past `end`, whose copies
    are masked) and which keys are real. Issues the block-table load only: nothing waits for it
    until `_copy_tile` uses the offsets, an iteration later."""
    real = keys < end
    block = gl.load(table_row + keys // PAGE, mask=real, other=0)
    offsets = block.to(gl.int64) * stride_cb + (keys % PAGE).to(gl.int64) * stride_cs
    return offsets, real


@gluon.jit
def _copy_rows(cache_ptr, rows, first: gl.constexpr, dims, buf):
    """Asynchronous copy of features `first + dims` of the key `rows` (offsets, real) into
    `buf`; keys past the segment are zero-filled."""
    offsets, real = rows
    ptrs = cache_ptr + gl.expand_dims(offsets, 1) + first + gl.expand_dims(dims, 0)
    mask = gl.expand_dims(real, 1) & gl.expand_dims(dims >= 0, 0)
    async_copy.async_copy_global_to_shared(buf, ptrs, mask=mask)


@gluon.jit
def _copy_first(cache_ptr, table_row, keys_c, keys_pe, dims_c, dims_pe, seg_hi, stride_cb,
                stride_cs, c_ring, pe_ring, L: gl.constexpr, PAGE: gl.constexpr,
                TILE: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """Prologue of the ring: copies of tiles 0 .. STAGES - 2 into their stages (one commit
    group each; the first also holds the copies issued before it), and the cache rows of tile
    STAGES - 1, which the loop's first iteration copies."""
    for stage in gl.static_range(0, STAGES - 1):
        rows_c = _key_rows(table_row, keys_c + stage * TILE, seg_hi, stride_cb, stride_cs, PAGE)
        rows_pe = _key_rows(table_row, keys_pe + stage * TILE, seg_hi, stride_cb, stride_cs,
                            PAGE)  # fmt: skip
        _copy_rows(cache_ptr, rows_c, 0, dims_c, c_ring.index(stage))
        _copy_rows(cache_ptr, rows_pe, L, dims_pe, pe_ring.index(stage))
        async_copy.commit_group()
    ahead = (STAGES - 1) * TILE
    return (_key_rows(table_row, keys_c + ahead, seg_hi, stride_cb, stride_cs, PAGE),
            _key_rows(table_row, keys_pe + ahead, seg_hi, stride_cb, stride_cs, PAGE))  # fmt: skip


@gluon.jit
def _copy_next(cache_ptr, table_row, rows, keys_c, keys_pe, dims_c, dims_pe, ahead, seg_hi,
               stride_cb, stride_cs, c_buf, pe_buf, L: gl.constexpr,
               PAGE: gl.constexpr):  # fmt: skip
    """One step of the ring: copy the tile whose cache `rows` (latent, rope) were loaded an
    iteration ago into `c_buf` / `pe_buf`, commit, and load the rows of the tile `ahead` keys
    past the segment's start (used next iteration)."""
    _copy_rows(cache_ptr, rows[0], 0, dims_c, c_buf)
    _copy_rows(cache_ptr, rows[1], L, dims_pe, pe_buf)
    async_copy.commit_group()
    return (_key_rows(table_row, keys_c + ahead, seg_hi, stride_cb, stride_cs, PAGE),
            _key_rows(table_row, keys_pe + ahead, seg_hi, stride_cb, stride_cs, PAGE))  # fmt: skip


@gluon.jit
def _finish(out_ptr, part_acc_ptr, part_lse_ptr, acc, out_scale, l_acc, m_i, qk_scale, t,
            segment, head0, heads_c, dims_c, num_heads, stride_ot, stride_oh, L: gl.constexpr,
            SPLIT: gl.constexpr, c_layout: gl.constexpr, s_layout: gl.constexpr,
            o_layout: gl.constexpr):  # fmt: skip
    """The output (`acc` times `out_scale` over the row sums) or, with SPLIT, the segment's
    partial output and log2-sum-exp (scores times `qk_scale` in log2 units)."""
    l_i = gl.sum(l_acc, axis=1)
    seen = l_i > 0.0
    norm = gl.where(seen, l_i, 1.0)
    norm_o = gl.expand_dims(gl.convert_layout(norm, gl.SliceLayout(1, o_layout)), 1)
    _store_chunk(out_ptr, part_acc_ptr, acc * (out_scale / norm_o), t, segment, heads_c, dims_c,
                 num_heads, stride_ot, stride_oh, L, SPLIT, c_layout)  # fmt: skip
    if SPLIT:
        lse2 = gl.where(seen, m_i * qk_scale + gl.log2(norm), float("-inf"))
        s_heads = head0 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
        part = (t * num_heads + s_heads) * gl.num_programs(1) + segment
        gl.store(part_lse_ptr + part, lse2, mask=s_heads < num_heads)


@gluon.jit
def mla_attention_sm90_kernel(
    out_ptr,  # [T, H, L]
    q_ptr,  # [T, H, L + R]
    cache_ptr,  # [num_blocks, PAGE, L + R], last dim contiguous
    block_table_ptr,  # [T, max_blocks] int32 (one request per token)
    seq_lens_ptr,  # [T] int32: cached keys of each request after this step
    part_acc_ptr,  # [T, H, num_segments, L] float32 (SPLIT only)
    part_lse_ptr,  # [T, H, num_segments] float32, log2 units (SPLIT only)
    scale,  # softmax scale
    num_heads,
    segment_len,  # keys per segment (SPLIT; a multiple of TILE)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_bt,
    L: gl.constexpr,
    R: gl.constexpr,
    PAGE: gl.constexpr,
    TILE: gl.constexpr,
    STAGES: gl.constexpr,
    SPLIT: gl.constexpr,
    QUERY_LEN: gl.constexpr,  # query tokens of every request (1: decode)
):
    BH: gl.constexpr = 64  # heads per program: the wgmma M side
    PE_COLS: gl.constexpr = R // 8  # threads across a rope row (16 bytes each)
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    # Register layouts: copies of latent rows (16-byte vectors, a warp covers 2 rows x 128
    # features) and of rope rows, the score tile (warpgroups split its keys) and the
    # accumulator (warpgroups split the features).
    c_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NUM_WARPS, 1], [1, 0])
    pe_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // PE_COLS, PE_COLS], [NUM_WARPS, 1],
                                               [1, 0])  # fmt: skip
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, TILE // 2, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, L // 2, 16]
    )
    q_smem = gl.allocate_shared_memory(
        dtype, [BH, L], gl.NVMMASharedLayout.get_default_for([BH, L], dtype)
    )
    qpe_smem = gl.allocate_shared_memory(
        dtype, [BH, R], gl.NVMMASharedLayout.get_default_for([BH, R], dtype)
    )
    c_smem = gl.allocate_shared_memory(
        dtype, [STAGES, TILE, L], gl.NVMMASharedLayout.get_default_for([TILE, L], dtype)
    )
    pe_smem = gl.allocate_shared_memory(
        dtype, [STAGES, TILE, R], gl.NVMMASharedLayout.get_default_for([TILE, R], dtype)
    )
    p_smem = gl.allocate_shared_memory(
        dtype, [BH, TILE], gl.NVMMASharedLayout.get_default_for([BH, TILE], dtype)
    )

    t, req, head0, segment, seg_lo, seg_hi, num_tiles = segment_of(
        seq_lens_ptr, segment_len, BH, TILE, QUERY_LEN
    )
    table_row = block_table_ptr + req * stride_bt
    q_ptr += t * stride_qt

    dims_c = gl.arange(0, L, layout=gl.SliceLayout(0, c_layout))
    dims_pe = gl.arange(0, R, layout=gl.SliceLayout(0, pe_layout))
    keys_c = seg_lo + gl.arange(0, TILE, layout=gl.SliceLayout(1, c_layout))
    keys_pe = seg_lo + gl.arange(0, TILE, layout=gl.SliceLayout(1, pe_layout))
    # Prologue: the query, then tiles 0 .. STAGES - 2 (the query lands with tile 0).
    heads_c = head0 + gl.arange(0, BH, layout=gl.SliceLayout(1, c_layout))
    heads_pe = head0 + gl.arange(0, BH, layout=gl.SliceLayout(1, pe_layout))
    q_rows = (gl.expand_dims(heads_c * stride_qh, 1), gl.expand_dims(heads_c < num_heads, 1))
    async_copy.async_copy_global_to_shared(
        q_smem, q_ptr + q_rows[0] + gl.expand_dims(dims_c, 0),
        mask=q_rows[1] & gl.expand_dims(dims_c >= 0, 0),
    )  # fmt: skip
    pe_rows = (gl.expand_dims(heads_pe * stride_qh, 1), gl.expand_dims(heads_pe < num_heads, 1))
    async_copy.async_copy_global_to_shared(
        qpe_smem, q_ptr + L + pe_rows[0] + gl.expand_dims(dims_pe, 0),
        mask=pe_rows[1] & gl.expand_dims(dims_pe >= 0, 0),
    )  # fmt: skip
    rows = _copy_first(cache_ptr, table_row, keys_c, keys_pe, dims_c, dims_pe, seg_hi, stride_cb,
                       stride_cs, c_smem, pe_smem, L, PAGE, TILE, STAGES)  # fmt: skip

    m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_acc = gl.zeros([BH, TILE], gl.float32, layout=s_layout)
    acc = gl.zeros([BH, L], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BH, TILE], gl.float32, layout=s_layout)
    cols = seg_lo + gl.arange(0, TILE, layout=gl.SliceLayout(0, s_layout))
    qk_scale = scale * LOG2E
    for i in range(num_tiles):
        # Issue tile i + STAGES - 1 (its table entries were loaded last iteration), then load
        # the entries of the tile after it, to be used next iteration.
        slot = (i + STAGES - 1) % STAGES
        rows = _copy_next(cache_ptr, table_row, rows, keys_c, keys_pe, dims_c, dims_pe,
                          (i + STAGES) * TILE, seg_hi, stride_cb, stride_cs, c_smem.index(slot),
                          pe_smem.index(slot), L, PAGE)  # fmt: skip
        async_copy.wait_group(STAGES - 1)  # this thread's copies of tile i have landed
        fence_async_shared()  # visible to the wgmma's async proxy
        gl.thread_barrier()  # ... and every other thread's
        c_tile = c_smem.index(i % STAGES)
        qk = warpgroup_mma(q_smem, c_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        qk = warpgroup_mma(qpe_smem, pe_smem.index(i % STAGES).permute((1, 0)), qk,
                           is_async=True)  # fmt: skip
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
        p, alpha, m_i, l_acc = _softmax(qk, cols < seg_hi, qk_scale, m_i, l_acc)
        p_smem.store(p.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        alpha_o = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        acc = warpgroup_mma(p_smem, c_tile, acc * alpha_o, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        cols += TILE
        # No barrier here: the compiler places one before the next iteration's copy into the
        # ring, which also keeps the next p from overwriting this one early.
    async_copy.wait_group(0)
    _finish(out_ptr, part_acc_ptr, part_lse_ptr, acc, 1.0, l_acc, m_i, qk_scale, t, segment,
            head0, heads_c, dims_c, num_heads, stride_ot, stride_oh, L, SPLIT, c_layout,
            s_layout, o_layout)  # fmt: skip
