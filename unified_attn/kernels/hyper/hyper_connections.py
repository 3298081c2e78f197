"""DeepSeek-V4's hyper-connection weights in one Triton launch (CUDA; the interpreter in tests).

From the mixes `[T, (2 + N) * N]` (float32: the streams' RMS-normalised projections) a
`HyperConnection` derives, per token, the collapse weights `pre [T, N]`, the expansion weights
`post [T, N]` and the residual mix `comb [T, N, N]`, made doubly stochastic by `iters` rounds
of Sinkhorn-Knopp. In torch that is about 120 small kernels per hyper-connection (two per layer),
which in a decode step are most of the model's launches. Here one program owns BLOCK_T tokens
and keeps each token's N x N matrix in registers through every round: the same float32 math in
the same order of operations (`deepseek_v4_layers.hc_weights` is the reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 32  # tokens per program


@triton.jit
def hc_weights_kernel(
    mixes_ptr,  # [T, (2 + N) * N] float32, contiguous
    base_ptr,  # [(2 + N) * N]
    scale_ptr,  # [3]: pre, post, comb
    pre_ptr,  # [T, N] float32
    post_ptr,  # [T, N] float32
    comb_ptr,  # [T, N, N] float32
    num_tokens,
    eps,
    ITERS: tl.constexpr,
    N: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    W: tl.constexpr = (2 + N) * N
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = t < num_tokens
    i = tl.arange(0, N)
    rows = mixes_ptr + t[:, None].to(tl.int64) * W
    pre_s = tl.load(scale_ptr).to(tl.float32)
    post_s = tl.load(scale_ptr + 1).to(tl.float32)
    comb_s = tl.load(scale_ptr + 2).to(tl.float32)
    pre_w = tl.load(rows + i[None, :], mask=ok[:, None], other=0.0)
    post_w = tl.load(rows + N + i[None, :], mask=ok[:, None], other=0.0)
    pre_b = tl.load(base_ptr + i).to(tl.float32)
    post_b = tl.load(base_ptr + N + i).to(tl.float32)
    pre = tl.sigmoid(pre_w * pre_s + pre_b[None, :]) + eps
    post = 2 * tl.sigmoid(post_w * post_s + post_b[None, :])
    cell = i[:, None] * N + i[None, :]  # [N, N]: row-major position in the matrix
    comb = tl.load(mixes_ptr + t[:, None, None].to(tl.int64) * W + 2 * N + cell[None, :, :],
                   mask=ok[:, None, None], other=0.0)  # fmt: skip
    comb = comb * comb_s + tl.load(base_ptr + 2 * N + cell).to(tl.float32)[None, :, :]
    comb = tl.exp(comb - tl.max(comb, axis=2)[:, :, None])  # softmax over each row
    comb = comb / tl.sum(comb, axis=2)[:, :, None] + eps
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
    for _ in tl.static_range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
    out = t[:, None] * N + i[None, :]
    tl.store(pre_ptr + out, pre, mask=ok[:, None])
    tl.store(post_ptr + out, post, mask=ok[:, None])
    tl.store(comb_ptr + t[:, None, None].to(tl.int64) * (N * N) + cell[None, :, :], comb,
             mask=ok[:, None, None])  # fmt: skip


def hc_weights(
    mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float, iters: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(pre [T, N], post [T, N], comb [T, N, N])` float32 from `mixes [T, (2 + N) * N]`
    (float32), `base [(2 + N) * N]` and `scale [3]`: `deepseek_v4_layers.hc_weights` in one
    launch. N must be a power of two (`serves`)."""
    num_tokens, width = mixes.shape
    n = serves_width(width)
    if n is None or mixes.dtype != torch.float32:
        raise ValueError(
            f"hyper-connection weights: mixes must be [T, (2 + N) * N] float32 with N a power "
            f"of two, got {tuple(mixes.shape)} {mixes.dtype}"
        )
    mixes = mixes.contiguous()
    pre = mixes.new_empty(num_tokens, n)
    post = mixes.new_empty(num_tokens, n)
    comb = mixes.new_empty(num_tokens, n, n)
    if num_tokens:
        hc_weights_kernel[(triton.cdiv(num_tokens, BLOCK_T),)](
            mixes, base.contiguous(), scale.contiguous(), pre, post, comb, num_tokens, eps,
            ITERS=iters, N=n, BLOCK_T=BLOCK_T,
        )  # fmt: skip
    return pre, post, comb


def serves_width(width: int) -> int | None:
    """N of mixes `(2 + N) * N` wide when N is a power of two (what the kernel serves)."""
    n = next((n for n in (1, 2, 4, 8, 16) if (2 + n) * n == width), None)
    return n
