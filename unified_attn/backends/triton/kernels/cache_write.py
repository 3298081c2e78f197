"""Write new K/V into paged caches at their slots (slot -1 = padding, skipped)."""

import triton
import triton.language as tl


@triton.jit
def write_kv_cache_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D], any strides
    v_cache_ptr,
    slot_mapping_ptr,  # [T] int64
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
):
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
    k_dst = block * stride_kcb + offset * stride_kcs + heads[:, None] * stride_kch
    v_dst = block * stride_vcb + offset * stride_vcs + heads[:, None] * stride_vch
    tl.store(k_cache_ptr + k_dst + dims[None, :] * stride_kcd, k, mask=mask)
    tl.store(v_cache_ptr + v_dst + dims[None, :] * stride_vcd, v, mask=mask)
