"""Launchers of the batch-invariant Triton kernels (`kernels.py`): check inputs, pick the
tile configuration from the reduced length and output width only (never from the number of
rows), and launch.

The GPU path of `ops.py`; the CPU interpreter (`TRITON_INTERPRET=1`) runs them in tests.
"""

from __future__ import annotations

import attrs
import torch
import triton

from unified_attn.models.invariant import kernels

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ROW_BLOCK_MAX = 4096  # longest chunk a row kernel holds at once; longer rows loop


@attrs.frozen
class MatmulConfig:
    """The tile of one matmul shape. A function of (N, K, dtype) only: every batch size runs
    the same tiles, so an element's K reduction is the same instruction sequence."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def matmul_config(n: int, k: int, dtype: torch.dtype) -> MatmulConfig:
    """16-bit inputs: 64-row tiles (the smallest Hopper warpgroup MMA); 128 columns for wide
    outputs, 64 or 32 for narrower ones, so a decode batch (one row tile) still spreads over
    enough programs without splitting K. float32 uses exact (`ieee`) FMA dots on 32 x 32 x 32
    tiles. Not yet tuned on a GPU: `benchmarks/batch_invariance.py` times every shape."""
    if dtype == torch.float32:
        return MatmulConfig(32, 32, 32, 8, 4, 2)
    block_n = 128 if n >= 8192 else 64 if n >= 2048 else 32
    return MatmulConfig(64, block_n, 64, 8, 4, 4)


def _check_matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(
            f"invariant matmul needs x [M, K] and w [K, N]; got x {tuple(x.shape)} and "
            f"w {tuple(w.shape)}"
        )
    if x.dtype not in SUPPORTED_DTYPES or w.dtype != x.dtype:
        raise ValueError(
            f"invariant matmul: x and w must share one dtype of {SUPPORTED_DTYPES}, got "
            f"{x.dtype} and {w.dtype}"
        )
    if bias is not None and (bias.shape != (w.shape[1],) or bias.device != x.device):
        raise ValueError(
            f"invariant matmul: bias must be [{w.shape[1]}] on {x.device}, got "
            f"{tuple(bias.shape)} on {bias.device}"
        )


def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x [M, K] @ w [K, N] (+ bias [N])` in x's dtype, float32 accumulation; any strides."""
    _check_matmul(x, w, bias)
    m, k = x.shape
    n = w.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = matmul_config(n, k, x.dtype)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    kernels.matmul_kernel[grid](
        x, w, out, bias if bias is not None else out, m, n, k,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def row_block(n: int) -> int:
    """Lanes of a row kernel: the row's next power of two, at most ROW_BLOCK_MAX."""
    return min(triton.next_power_of_2(max(n, 1)), ROW_BLOCK_MAX)


def row_warps(block: int) -> int:
    return 8 if block >= 2048 else 4


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as `[rows, N]` with a contiguous last dimension (a copy only if needed)."""
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"invariant row op: dtype must be one of {SUPPORTED_DTYPES}, got {x.dtype}"
        )
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


STYLES = {"llama": 0, "float32": 1, "gemma": 2}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, style: str) -> torch.Tensor:
    """`layers.RMSNorm` of `style` over the last dimension, one program per row."""
    rows = _rows(x)
    n = rows.shape[1]
    if weight.shape != (n,):
        raise ValueError(f"rms_norm: weight must be [{n}], got {tuple(weight.shape)}")
    out_dtype = torch.promote_types(weight.dtype, x.dtype) if style == "llama" else x.dtype
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    if rows.shape[0]:
        block = row_block(n)
        kernels.rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, rows.stride(0), out.stride(0), n, eps,
            STYLE=STYLES[style], BLOCK=block, num_warps=row_warps(block),
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    rows = _rows(x)
    n = rows.shape[1]
    out = torch.empty_like(rows)
    if rows.shape[0]:
        block = row_block(n)
        kernels.layer_norm_kernel[(rows.shape[0],)](
            rows, weight, bias, out, rows.stride(0), out.stride(0), n, eps,
            BLOCK=block, num_warps=row_warps(block),
        )  # fmt: skip
    return out.view(x.shape)


def l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    rows = _rows(x)
    n = rows.shape[1]
    out = torch.empty_like(rows)
    if rows.shape[0]:
        block = row_block(n)
        kernels.l2_normalize_kernel[(rows.shape[0],)](
            rows, out, rows.stride(0), out.stride(0), n, eps,
            BLOCK=block, num_warps=row_warps(block),
        )  # fmt: skip
    return out.view(x.shape)


def softmax(x: torch.Tensor, log: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Softmax (or log-softmax) over the last dimension, float32 inside, out in `dtype`."""
    rows = _rows(x)
    n = rows.shape[1]
    out = torch.empty(rows.shape, dtype=dtype or x.dtype, device=x.device)
    if rows.shape[0]:
        block = row_block(n)
        kernels.softmax_kernel[(rows.shape[0],)](
            rows, out, rows.stride(0), out.stride(0), n,
            LOG=log, BLOCK=block, num_warps=row_warps(block),
        )  # fmt: skip
    return out.view(x.shape)
