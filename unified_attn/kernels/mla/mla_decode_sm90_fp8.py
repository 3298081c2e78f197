"""Hopper (sm90) MLA decode over an fp8 (e4m3) latent cache, written in Gluon.

Same contract as the lockstep kernel (mla_attention_sm90.py: one program per token, 64 heads
and one segment of keys; split-KV partials merged by `merge_partials_kernel`), with a cache of
float8 e4m3 latents that each stand for their value times `kv_scale` (a 0-dim float32 tensor).

Hopper's tensor cores take no mixed fp8 x 16-bit product, so every key tile is dequantized
into shared memory before its two wgmma products, and that work overlaps the tensor cores':

- two float16 tile buffers: while the score products of tile i (in one) run, the threads load
  tile i + 1's fp8 bytes (four chunks of 16 latent rows and the rope rows, 16-byte vectors,
  through block-table entries loaded an iteration earlier) and convert them into the other
  (one `cvt.rn.f16x2.e4m3x2` per two values); the value products of tile i then read only its
  own buffer;
- the products run in float16, exact for every e4m3 value. bf16 queries are brought into
  float16's range first: each (token, head) row is divided by the power of two that puts its
  largest magnitude under 2^14 (exact), and that factor multiplies the row's scores. The scale
  of the cache multiplies the softmax scale and, once at the end, the accumulator.

Shared memory at L = 512, R = 64, TILE = 64: 72 KiB of query, 2 x 72 KiB of float16 keys and
8 KiB of probabilities: 224 KiB, no room for a ring of fp8 copies besides. Loading the next
tile's bytes a whole iteration ahead instead keeps them live across the softmax and spills
(measured: benchmarks/README.md, "fp8 latent cache").
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from unified_attn.kernels.mla.mla_attention_sm90 import _finish, segment_of
from unified_attn.kernels.sparse.gathered_attention_sm90 import _softmax

LOG2E = gl.constexpr(1.4426950408889634)
NUM_WARPS: gl.constexpr = gl.constexpr(8)  # two warpgroups
F16_MAX_ROW: gl.constexpr = gl.constexpr(16384.0)  # query rows are scaled under 2^14


@gluon.jit
def _blocks(table_row, keys, end, PAGE: gl.constexpr):
    """Block-table entries of `keys` (0 past `end`)."""
    return gl.load(table_row + keys // PAGE, mask=keys < end, other=0)


@gluon.jit
def _load_rows(cache_ptr, blocks, keys, end, first: gl.constexpr, dims, stride_cb, stride_cs,
               PAGE: gl.constexpr):  # fmt: skip
    """Features `first + dims` of the cache rows of `keys` (their `blocks` loaded earlier) into
    registers; keys at or past `end` read as 0."""
    offsets = blocks.to(gl.int64) * stride_cb + (keys % PAGE).to(gl.int64) * stride_cs
    ptrs = cache_ptr + gl.expand_dims(offsets, 1) + first + gl.expand_dims(dims, 0)
    mask = gl.expand_dims(keys < end, 1) & gl.expand_dims(dims >= 0, 0)
    return gl.load(ptrs, mask=mask, other=0.0)


@gluon.jit
def _queries(q_ptr, q_smem, qpe_smem, heads, dims, heads_pe, dims_pe, num_heads, stride_qh,
             L: gl.constexpr, layout: gl.constexpr, pe_layout: gl.constexpr):  # fmt: skip
    """The token's query rows `[64, L]` and `[64, R]` as float16 in shared memory, and each
    row's power-of-two divisor (1 for float16 queries) in `layout`'s row slice."""
    rows = gl.expand_dims(heads < num_heads, 1)
    q = gl.load(q_ptr + gl.expand_dims(heads * stride_qh, 1) + gl.expand_dims(dims, 0),
                mask=rows & gl.expand_dims(dims >= 0, 0), other=0.0).to(gl.float32)  # fmt: skip
    pe_rows = gl.expand_dims(heads_pe < num_heads, 1)
    pe_ptrs = q_ptr + L + gl.expand_dims(heads_pe * stride_qh, 1) + gl.expand_dims(dims_pe, 0)
    qpe = gl.load(pe_ptrs, mask=pe_rows & gl.expand_dims(dims_pe >= 0, 0), other=0.0)
    qpe = qpe.to(gl.float32)
    if q_ptr.dtype.element_ty == gl.bfloat16:
        amax = gl.maximum(gl.max(gl.abs(q), axis=1),
                          gl.convert_layout(gl.max(gl.abs(qpe), axis=1),
                                            gl.SliceLayout(1, layout)))  # fmt: skip
        divisor = gl.where(amax > F16_MAX_ROW, gl.exp2(gl.ceil(gl.log2(amax / F16_MAX_ROW))), 1.0)
    else:
        divisor = gl.full([q.shape[0]], 1.0, gl.float32, layout=gl.SliceLayout(1, layout))
    q_smem.store((q / gl.expand_dims(divisor, 1)).to(gl.float16))
    pe_divisor = gl.convert_layout(divisor, gl.SliceLayout(1, pe_layout))
    qpe_smem.store((qpe / gl.expand_dims(pe_divisor, 1)).to(gl.float16))
    return divisor


@gluon.jit
def _tile_keys(tile, seg_lo, TILE: gl.constexpr, CHUNK: gl.constexpr, c8_layout: gl.constexpr,
               pe8_layout: gl.constexpr):  # fmt: skip
    """Tile `tile`'s keys: the first latent row chunk's (the others follow by CHUNK) and the
    rope rows'."""
    first = seg_lo + tile * TILE
    return (first + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, c8_layout)),
            first + gl.arange(0, TILE, layout=gl.SliceLayout(1, pe8_layout)))  # fmt: skip


@gluon.jit
def _tile_blocks(table_row, tile, seg_lo, seg_hi, PAGE: gl.constexpr, TILE: gl.constexpr,
                 CHUNK: gl.constexpr, c8_layout: gl.constexpr,
                 pe8_layout: gl.constexpr):  # fmt: skip
    """Block-table entries of tile `tile` of the segment: its four latent row chunks' and its
    rope rows'."""
    rows, keys_pe = _tile_keys(tile, seg_lo, TILE, CHUNK, c8_layout, pe8_layout)
    return (
        _blocks(table_row, rows, seg_hi, PAGE),
        _blocks(table_row, rows + CHUNK, seg_hi, PAGE),
        _blocks(table_row, rows + 2 * CHUNK, seg_hi, PAGE),
        _blocks(table_row, rows + 3 * CHUNK, seg_hi, PAGE),
        _blocks(table_row, keys_pe, seg_hi, PAGE),
    )


@gluon.jit
def _load_tile(cache_ptr, blocks, tile, seg_lo, seg_hi, stride_cb, stride_cs, L: gl.constexpr,
               R: gl.constexpr, PAGE: gl.constexpr, TILE: gl.constexpr, CHUNK: gl.constexpr,
               c8_layout: gl.constexpr, pe8_layout: gl.constexpr):  # fmt: skip
    """Tile `tile`'s fp8 bytes in registers: four chunks of latent rows and the rope rows."""
    rows, keys_pe = _tile_keys(tile, seg_lo, TILE, CHUNK, c8_layout, pe8_layout)
    dims = gl.arange(0, L, layout=gl.SliceLayout(0, c8_layout))
    dims_pe = gl.arange(0, R, layout=gl.SliceLayout(0, pe8_layout))
    b0, b1, b2, b3, b_pe = blocks
    strides = (stride_cb, stride_cs)
    return (
        _load_rows(cache_ptr, b0, rows, seg_hi, 0, dims, *strides, PAGE),
        _load_rows(cache_ptr, b1, rows + CHUNK, seg_hi, 0, dims, *strides, PAGE),
        _load_rows(cache_ptr, b2, rows + 2 * CHUNK, seg_hi, 0, dims, *strides, PAGE),
        _load_rows(cache_ptr, b3, rows + 3 * CHUNK, seg_hi, 0, dims, *strides, PAGE),
        _load_rows(cache_ptr, b_pe, keys_pe, seg_hi, L, dims_pe, *strides, PAGE),
    )


@gluon.jit
def _dequantize(raw, c_smem, pe_smem, CHUNK: gl.constexpr):
    """A tile's fp8 bytes (`_load_tile`) as float16 into `c_smem [TILE, L]` and `pe_smem
    [TILE, R]` (exact), a chunk of rows at a time."""
    c0, c1, c2, c3, pe = raw
    c_smem.slice(0, CHUNK).store(c0.to(gl.float16))
    c_smem.slice(CHUNK, CHUNK).store(c1.to(gl.float16))
    c_smem.slice(2 * CHUNK, CHUNK).store(c2.to(gl.float16))
    c_smem.slice(3 * CHUNK, CHUNK).store(c3.to(gl.float16))
    pe_smem.store(pe.to(gl.float16))


@gluon.jit
def mla_decode_sm90_fp8_kernel(
    out_ptr,  # [T, H, L]
    q_ptr,  # [T, H, L + R] bf16 or float16
    cache_ptr,  # [num_blocks, PAGE, L + R] float8 e4m3, last dim contiguous
    block_table_ptr,  # [T, max_blocks] int32 (one request per token)
    seq_lens_ptr,  # [T] int32: cached keys of each request after this step
    part_acc_ptr,  # [T, H, num_segments, L] float32 (SPLIT only)
    part_lse_ptr,  # [T, H, num_segments] float32, log2 units (SPLIT only)
    kv_scale_ptr,  # 0-dim float32: the cache's scale
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
    SPLIT: gl.constexpr,
    QUERY_LEN: gl.constexpr,  # query tokens of every request (1: decode)
):
    BH: gl.constexpr = 64  # heads per program: the wgmma M side
    CHUNK: gl.constexpr = TILE // 4  # latent rows a register chunk of a tile holds
    # fp8 rows: 16-byte vectors, a warp covers one latent row.
    c8_layout: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [NUM_WARPS, 1], [1, 0])
    pe8_layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (R // 16), R // 16],
                                                [NUM_WARPS, 1], [1, 0])  # fmt: skip
    # 16-bit rows (queries and output): 16-byte vectors, a warp covers 2 rows x 128 features.
    c_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NUM_WARPS, 1], [1, 0])
    pe_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (R // 8), R // 8], [NUM_WARPS, 1],
                                               [1, 0])  # fmt: skip
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, TILE // 2, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, L // 2, 16]
    )
    f16: gl.constexpr = gl.float16
    q_smem = gl.allocate_shared_memory(
        f16, [BH, L], gl.NVMMASharedLayout.get_default_for([BH, L], f16)
    )
    qpe_smem = gl.allocate_shared_memory(
        f16, [BH, R], gl.NVMMASharedLayout.get_default_for([BH, R], f16)
    )
    c_smem = gl.allocate_shared_memory(
        f16, [2, TILE, L], gl.NVMMASharedLayout.get_default_for([TILE, L], f16)
    )
    pe_smem = gl.allocate_shared_memory(
        f16, [2, TILE, R], gl.NVMMASharedLayout.get_default_for([TILE, R], f16)
    )
    p_smem = gl.allocate_shared_memory(
        f16, [BH, TILE], gl.NVMMASharedLayout.get_default_for([BH, TILE], f16)
    )

    t, req, head0, segment, seg_lo, seg_hi, num_tiles = segment_of(
        seq_lens_ptr, segment_len, BH, TILE, QUERY_LEN
    )
    table_row = block_table_ptr + req * stride_bt
    q_ptr += t * stride_qt
    # Prologue: tile 0 dequantized into buffer 0, tile 1's block-table entries, the query.
    blocks = _tile_blocks(table_row, 0, seg_lo, seg_hi, PAGE, TILE, CHUNK, c8_layout, pe8_layout)
    raw = _load_tile(cache_ptr, blocks, 0, seg_lo, seg_hi, stride_cb, stride_cs, L, R, PAGE, TILE,
                     CHUNK, c8_layout, pe8_layout)  # fmt: skip
    blocks = _tile_blocks(table_row, 1, seg_lo, seg_hi, PAGE, TILE, CHUNK, c8_layout, pe8_layout)
    heads_o = head0 + gl.arange(0, BH, layout=gl.SliceLayout(1, c_layout))
    dims_o = gl.arange(0, L, layout=gl.SliceLayout(0, c_layout))
    heads_pe = head0 + gl.arange(0, BH, layout=gl.SliceLayout(1, pe_layout))
    divisor = _queries(q_ptr, q_smem, qpe_smem, heads_o, dims_o, heads_pe,
                       gl.arange(0, R, layout=gl.SliceLayout(0, pe_layout)), num_heads,
                       stride_qh, L, c_layout, pe_layout)  # fmt: skip
    _dequantize(raw, c_smem.index(0), pe_smem.index(0), CHUNK)
    fence_async_shared()
    kv_scale = gl.load(kv_scale_ptr)
    row_factor = gl.expand_dims(gl.convert_layout(divisor, gl.SliceLayout(1, s_layout)), 1)

    m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_acc = gl.zeros([BH, TILE], gl.float32, layout=s_layout)
    acc = gl.zeros([BH, L], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BH, TILE], gl.float32, layout=s_layout)
    cols = seg_lo + gl.arange(0, TILE, layout=gl.SliceLayout(0, s_layout))
    qk_scale = scale * LOG2E * kv_scale
    for i in range(num_tiles):
        # Tile i is dequantized in buffer i % 2 (fenced). While its score products run, tile
        # i + 1 is loaded and dequantized into the other buffer (last read by the previous
        # tile's value products, which every warpgroup waited for before the barrier).
        gl.thread_barrier()
        cur = i % 2
        qk = warpgroup_mma(q_smem, c_smem.index(cur).permute((1, 0)), s_zero, use_acc=False,
                           is_async=True)  # fmt: skip
        qk = warpgroup_mma(qpe_smem, pe_smem.index(cur).permute((1, 0)), qk, is_async=True)
        nxt = _load_tile(cache_ptr, blocks, i + 1, seg_lo, seg_hi, stride_cb, stride_cs, L, R,
                         PAGE, TILE, CHUNK, c8_layout, pe8_layout)  # fmt: skip
        blocks = _tile_blocks(table_row, i + 2, seg_lo, seg_hi, PAGE, TILE, CHUNK, c8_layout,
                              pe8_layout)  # fmt: skip
        _dequantize(nxt, c_smem.index(1 - cur), pe_smem.index(1 - cur), CHUNK)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
        p, alpha, m_i, l_acc = _softmax(qk * row_factor, cols < seg_hi, qk_scale, m_i, l_acc)
        p_smem.store(p.to(f16))
        fence_async_shared()  # the probabilities and tile i + 1, for the async proxy
        gl.thread_barrier()
        alpha_o = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        acc = warpgroup_mma(p_smem, c_smem.index(cur), acc * alpha_o, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        cols += TILE

    _finish(out_ptr, part_acc_ptr, part_lse_ptr, acc, kv_scale, l_acc, m_i, qk_scale, t, segment,
            head0, heads_o, dims_o, num_heads, stride_ot, stride_oh, L, SPLIT, c_layout,
            s_layout, o_layout)  # fmt: skip
