"""Batch-invariant building blocks: a row's result never depends on how many other rows are
computed with it, nor on where it sits among them.

On CUDA each op is a Triton kernel (`kernels/invariant/invariant_launch.py`) whose tiles and
reduction order depend on the reduced length only. On the CPU (tests, `--quick` benchmarks)
each row goes through a torch call whose shapes do not depend on the number of rows, which
makes the result per row the same by construction:

- a matmul is a batched product of `[1, K] @ [K, N]` matrices (`torch.bmm` over a stride-0
  view of the weight), so MKL never sees the row count: measured, `F.linear` on MKL is not
  invariant (1 row takes a GEMV path, 2-3 rows and 4+ rows GEMM paths that round
  differently, and a row's position inside the batch changes its bits too);
- a row reduction (sum of squares, mean) is the same batched `[1, N] @ [N, 1]` product, and
  the rest of a norm is element-wise with correctly rounded `sqrt` and `/`;
- a softmax runs row by row on `[N]` vectors.

Element-wise ops (activations, RoPE, residual adds) need nothing on CUDA, where every element
runs the same code. On the CPU, torch's vectorised loops finish a tensor's (and each thread's)
last partial vector with scalar libm calls, which differ from the vector ones by an ulp for
`silu` and `sigmoid` (measured). The vector holds 16 floats with AVX2 (two per step) and 32 with
AVX-512, so whether a `[T, 48]` tensor reaches that tail depends on T on one machine and not on
another: `elementwise` pads the flattened tensor to whole steps of every thread first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _on_gpu(x: torch.Tensor) -> bool:
    return x.device.type == "cuda"


def invariant_matmul(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`x [M, K] @ w [K, N] (+ bias [N])` in x's dtype; row i of the result depends on
    `x[i]`, `w` and `bias` only. Accumulates in float32 (CUDA), bias added before rounding."""
    if _on_gpu(x):
        from unified_attn.kernels.invariant import invariant_launch as triton_ops

        return triton_ops.matmul(x, w, bias)
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(
            f"invariant matmul needs x [M, K] and w [K, N]; got x {tuple(x.shape)} and "
            f"w {tuple(w.shape)}"
        )
    m, k = x.shape
    out = torch.bmm(x[:, None, :], w.expand(m, k, w.shape[1]))[:, 0]  # [M, N]
    return out if bias is None else out + bias


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`nn.functional.linear` (weight `[N, K]`) over any leading dimensions, batch-invariant."""
    rows = x.reshape(-1, x.shape[-1])
    out = invariant_matmul(rows, weight.t(), bias)
    return out.view(*x.shape[:-1], weight.shape[0])


CPU_VECTOR_STEP = 64  # floats: a multiple of every CPU's vectorised step (AVX-512: 2 x 16)


def elementwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn(x)` for an element-wise `fn`, each element the same whatever the tensor's size. On
    the CPU the flattened tensor is padded with zeros to a multiple of `CPU_VECTOR_STEP` per
    thread, so neither the tensor's end nor a thread's share of it leaves a partial vector
    for torch's scalar code (torch splits a range into equal shares, one per thread)."""
    if _on_gpu(x):
        return fn(x)
    flat = x.reshape(-1)
    pad = -flat.numel() % (CPU_VECTOR_STEP * torch.get_num_threads())
    return fn(torch.nn.functional.pad(flat, (0, pad)))[: flat.numel()].view(x.shape)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """`torch.sigmoid`, element by element the same whatever the tensor's size."""
    return elementwise(torch.sigmoid, x)


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """CPU: `sum(a * b)` of each row of `[R, N]` float tensors -> `[R]`, one fixed-shape
    product per row."""
    return torch.bmm(a[:, None, :], b[:, :, None])[:, 0, 0]


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, style: str = "llama"
) -> torch.Tensor:
    """`layers.RMSNorm` over the last dimension (same styles: `llama`, `float32`, `gemma`),
    each row on its own."""
    if _on_gpu(x):
        from unified_attn.kernels.invariant import invariant_launch as triton_ops

        return triton_ops.rms_norm(x, weight, eps, style)
    rows = x.reshape(-1, x.shape[-1]).float()
    inv = 1.0 / torch.sqrt(_row_dot(rows, rows) / rows.shape[1] + eps)
    xf = (rows * inv[:, None]).view(x.shape)
    if style == "gemma":
        return (xf * (1.0 + weight.float())).to(x.dtype)
    if style == "float32":
        return (weight * xf).to(x.dtype)
    return weight * xf.to(x.dtype)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """LayerNorm over the last dimension (biased variance), float32 inside, each row on its
    own."""
    if _on_gpu(x):
        from unified_attn.kernels.invariant import invariant_launch as triton_ops

        return triton_ops.layer_norm(x, weight, bias, eps)
    rows = x.reshape(-1, x.shape[-1]).float()
    n = rows.shape[1]
    mean = _row_dot(rows, torch.ones_like(rows)) / n
    centered = rows - mean[:, None]
    inv = 1.0 / torch.sqrt(_row_dot(centered, centered) / n + eps)
    out = centered * inv[:, None] * weight.float() + bias.float()
    return out.to(x.dtype).view(x.shape)


def l2_normalize(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """`F.normalize(x, dim=-1)`: `x / max(||x||, eps)` with the norm in float32, each row on
    its own."""
    if _on_gpu(x):
        from unified_attn.kernels.invariant import invariant_launch as triton_ops

        return triton_ops.l2_normalize(x, eps)
    rows = x.reshape(-1, x.shape[-1]).float()
    norm = torch.sqrt(_row_dot(rows, rows)).clamp_min(eps)
    return (rows / norm[:, None]).to(x.dtype).view(x.shape)


def softmax(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Softmax over the last dimension in float32, returned in `dtype` (default x's)."""
    return _softmax(x, log=False, dtype=dtype)


def log_softmax(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Log-softmax over the last dimension in float32, returned in `dtype` (default x's)."""
    return _softmax(x, log=True, dtype=dtype)


def _softmax(x: torch.Tensor, log: bool, dtype: torch.dtype | None) -> torch.Tensor:
    if _on_gpu(x):
        from unified_attn.kernels.invariant import invariant_launch as triton_ops

        return triton_ops.softmax(x, log=log, dtype=dtype)
    fn = torch.log_softmax if log else torch.softmax
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape, dtype=dtype or x.dtype, device=x.device)
    for i in range(rows.shape[0]):  # one [N] call per row: the same kernel for every row
        out[i] = fn(rows[i].float(), dim=-1)
    return out.view(x.shape)
