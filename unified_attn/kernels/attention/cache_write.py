"""Write new K/V into paged caches at their slots (slot -1 = padding, skipped); into an fp8
cache quantized with saturation: `e4m3(clamp(x / scale, -448, 448))`, round to nearest even."""

import triton
import triton.language as tl

from unified_attn.kernels.pdl_jit import pdl_start


@triton.jit
def round_to_e4m3(y):
    """float32 `y` (|y| <= 448) rounded to nearest even onto the float8 e4m3 grid, still in
    float32, so the cast to float8 that follows is exact. (The cast alone would do on the GPU,
    but Triton's CPU interpreter rounds it wrongly; this keeps both bitwise equal to torch.)"""
    bits = y.to(tl.int32, bitcast=True)
    # normal range (|y| >= 2^-6): keep 3 mantissa bits, ties to even; a carry bumps the exponent
    keep = bits + 0x7FFFF + ((bits >> 20) & 1)
    normal = (keep & -1048576).to(tl.float32, bitcast=True)  # -1048576 = 0xFFF00000
    # subnormal range: multiples of 2^-9, by the float32 add (24576 = 1.5 * 2^14: ulp 2^-9)
    magnitude = (tl.abs(y) + 24576.0) - 24576.0
    subnormal = tl.where(bits < 0, magnitude * -1.0, magnitude)  # * -1 keeps the sign of 0
    return tl.where(tl.abs(y) < 0.015625, subnormal, normal)


@triton.jit
def quantize_e4m3(x, scale):
    """`x / scale` (IEEE division, as torch) saturated to +-448 (NaN stays NaN), as float8."""
    y = tl.math.div_rn(x.to(tl.float32), scale)
    y = tl.clamp(y, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    return round_to_e4m3(y).to(tl.float8e4nv)


@triton.jit
def write_kv_cache_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D], any strides
    v_cache_ptr,
    slot_mapping_ptr,  # [T] int64
    kv_scales_ptr,  # [2] float32 (k_scale, v_scale) of an fp8 cache, else a dummy
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8_KV: tl.constexpr,  # the caches are float8 e4m3: quantize with the scales
    launch_pdl: tl.constexpr = False,  # kernels/pdl.py
):
    pdl_start(launch_pdl)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_SIZE)
    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(
        value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask
    )
    if FP8_KV:
        k = quantize_e4m3(k, tl.load(kv_scales_ptr))
        v = quantize_e4m3(v, tl.load(kv_scales_ptr + 1))
    k_dst = block * stride_kcb + offset * stride_kcs + heads[:, None] * stride_kch
    v_dst = block * stride_vcb + offset * stride_vcs + heads[:, None] * stride_vch
    tl.store(k_cache_ptr + k_dst + dims[None, :] * stride_kcd, k, mask=mask)
    tl.store(v_cache_ptr + v_dst + dims[None, :] * stride_vcd, v, mask=mask)
