"""Log-sum-exp merge of split-KV partials, shared by the MLA and gathered (DeepSeek-V4)
attention launchers: `merge_partials_kernel` (jit code only; the MLA launchers call it through
`backends/triton/merge_ops.py`)."""

import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def merge_partials_kernel(
    out_ptr,  # [T, H, D] output dtype
    lse_ptr,  # WRITE_LSE: [T, H] float32, natural log
    part_out_ptr,  # [T, H, num_parts, D] float32, each part's normalised output
    part_lse_ptr,  # [T, H, num_parts] float32, log2 units
    num_heads,
    num_parts,
    stride_ot,
    stride_oh,
    D: tl.constexpr,
    PARTS_PAD: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    """One (token, head): weights `2^(lse_p - max)`; a part that sees no key (lse -inf) weighs
    0 and its partial is not read; a row that sees none at all gets a zero output and, with
    WRITE_LSE, lse -inf."""
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    parts = tl.arange(0, PARTS_PAD)
    dims = tl.arange(0, D)
    base = (t * num_heads + head) * num_parts
    lse = tl.load(part_lse_ptr + base + parts, mask=parts < num_parts, other=float("-inf"))
    top = tl.max(lse, axis=0)
    shift = tl.where(top > float("-inf"), top, 0.0)
    weight = tl.exp2(lse - shift)  # 0 where lse = -inf
    total = tl.sum(weight, axis=0)
    seen = lse > float("-inf")
    partial = tl.load(
        part_out_ptr + (base + parts)[:, None] * D + dims[None, :], mask=seen[:, None], other=0.0
    )
    norm = tl.where(total > 0.0, total, 1.0)
    out = tl.sum(partial * weight[:, None], axis=0) / norm
    tl.store(out_ptr + t * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))
    if WRITE_LSE:
        merged = tl.where(total > 0.0, (shift + tl.log2(norm)) * LN2, float("-inf"))
        tl.store(lse_ptr + t * num_heads + head, merged)
