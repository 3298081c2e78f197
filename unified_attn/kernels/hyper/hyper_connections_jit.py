"""The hyper-connection weights kernel (jit code only; the launcher is `hyper_connections.py`)."""

import triton
import triton.language as tl


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
