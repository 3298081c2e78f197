"""The merge of `unified_attention_kernel`'s split-KV segments: each segment's unnormalised
partial output, max and sum of exponentials combined by log-sum-exp into the output."""

import triton
import triton.language as tl

from unified_attn.kernels.attention.unified_attention import LOG2E
from unified_attn.kernels.pdl_jit import pdl_start


@triton.jit
def merge_segments_kernel(
    out_ptr,  # [T, Hq, D]
    seg_acc_ptr,  # [T, Hq, NUM_SEGMENTS, HEAD_PAD]
    seg_max_ptr,  # [T, Hq, NUM_SEGMENTS]
    seg_sum_ptr,
    sinks_ptr,
    num_q_heads,
    stride_ot,
    stride_oh,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    USE_SINKS: tl.constexpr,
    launch_pdl: tl.constexpr = False,  # kernels/pdl.py
):
    """Log-sum-exp merge (log2 units) of the partial results of one (token, head). Empty
    segments carry max = -inf and sum = 0 and drop out; the sink is counted here, once."""
    pdl_start(launch_pdl)
    token = tl.program_id(0)
    head = tl.program_id(1)
    segs = tl.arange(0, NUM_SEGMENTS)
    dims = tl.arange(0, HEAD_PAD)
    base = (token * num_q_heads + head) * NUM_SEGMENTS
    m = tl.load(seg_max_ptr + base + segs)
    sums = tl.load(seg_sum_ptr + base + segs)
    m_all = tl.max(m, axis=0)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
        m_all = tl.maximum(m_all, sink)
    m_safe = tl.where(m_all > float("-inf"), m_all, 0.0)
    weight = tl.where(m > float("-inf"), tl.exp2(m - m_safe), 0.0)
    total = tl.sum(sums * weight, axis=0)
    if USE_SINKS:
        total += tl.exp2(sink - m_safe)
    acc = tl.load(seg_acc_ptr + (base + segs)[:, None] * HEAD_PAD + dims[None, :])
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_SIZE,
    )
