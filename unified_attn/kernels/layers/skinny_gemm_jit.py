"""A GEMM for decode rows (launcher: `skinny_gemm.py`): `y = x @ W^T (+ bias)` for a few rows
(M <= BLOCK_M, 16 to 64) against a weight `W [N, K]` read once, each program owning BLOCK_N output
columns over the whole of K (no split-K, no reduction kernel).

The residual add + RMSNorm and the gated activation stay in their own kernels: fused in front of
this GEMM as a prologue (the values computed per K chunk in every program) they made it 1.4x
slower for q/k/v and 5.7x for down on the H200 (benchmarks/README.md, "Where the decode step's
device time goes"), far more than the launch they saved.
"""

from __future__ import annotations

import triton
import triton.language as tl

from unified_attn.kernels.pdl_jit import pdl_start


@triton.jit
def skinny_gemm_kernel(
    x_ptr,  # [M, K], rows contiguous
    w_ptr,  # [N, K], rows contiguous
    bias_ptr,  # [N] or unused
    y_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT: tl.constexpr,  # tl.dot input precision: "ieee" for float32 inputs
    launch_pdl: tl.constexpr = False,  # kernels/pdl.py
):
    pdl_start(launch_pdl)
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    row_ok = rm < M
    col_ok = rn < N
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + k[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        a = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(a, tl.trans(w.to(dt)), acc, input_precision=DOT)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip
