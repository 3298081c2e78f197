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

from unified_attn.kernels.hyper.hyper_connections_jit import hc_weights_kernel

BLOCK_T = 32  # tokens per program


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
