"""Launchers of the batch-invariant Triton kernels (`invariant_kernels.py`): check inputs, pick the
tile configuration (its reduction from the reduced length and dtype only, never from the
number of rows), and launch.

The GPU path of `ops.py`; the CPU interpreter (`TRITON_INTERPRET=1`) runs them in tests.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import triton

from unified_attn.kernels.invariant import invariant_kernels as kernels

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ROW_BLOCK_MAX = 4096  # longest chunk a row kernel holds at once; longer rows loop


@attrs.frozen
class MatmulConfig:
    """The tile of one matmul launch. Its reduction (`block_k`, the dot's precision) is a
    function of (K, dtype) only: every batch size walks an element's K in the same steps of the
    same MMA instruction, so the element has the same bits whatever tile holds it."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


LARGE_ROWS = 1024  # from here on 16-bit matmuls take the prefill tiles


def matmul_config(n: int, k: int, dtype: torch.dtype, m: int = 1) -> MatmulConfig:
    """float32: exact (`ieee`) FMA dots on 32 x 32 x 32 tiles for every shape. 16-bit inputs
    always reduce K in steps of 64 on Hopper's warpgroup MMA; only the output tile follows the
    row count `m`: decode-sized batches take 64-row tiles (64 to 128 columns, so one row tile
    still spreads over enough programs without splitting K), prefill-sized ones 128 x 128
    (128 x 256 for vocabulary-wide outputs) with 8 warps. Measured on an H100
    (`benchmarks/tune_invariant_matmul.py`): every candidate tile gives the same bits as
    every other, and these were the fastest at 64 and 8192 rows."""
    if dtype == torch.float32:
        return MatmulConfig(32, 32, 32, 8, 4, 2)
    if m >= LARGE_ROWS:
        return MatmulConfig(128, 256 if n >= 16384 else 128, 64, 8, 8, 3)
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


def matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: MatmulConfig | None = None,
) -> torch.Tensor:
    """`x [M, K] @ w [K, N] (+ bias [N])` in x's dtype, float32 accumulation; any strides.
    `config` overrides `matmul_config` (benchmarks/tune_invariant_matmul.py)."""
    _check_matmul(x, w, bias)
    m, k = x.shape
    n = w.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = config or matmul_config(n, k, x.dtype, m)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    kernels.matmul_kernel[grid](
        x, w, out, bias if bias is not None else out, m, n, k,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", EVEN_K=k % cfg.block_k == 0,
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


def _per_row(
    kernel: Any,
    rows: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    scalars: tuple[float, ...],
    **constexprs: Any,
) -> torch.Tensor:
    """Launch a row kernel, one program per row of `rows [R, N]`; its arguments are `rows`,
    the weights, `out`, both row strides, N, the scalars, then the constexprs and the tile."""
    if rows.shape[0]:
        n = rows.shape[1]
        block = row_block(n)
        kernel[(rows.shape[0],)](
            rows, *weights, out, rows.stride(0), out.stride(0), n, *scalars,
            BLOCK=block, num_warps=row_warps(block), **constexprs,
        )  # fmt: skip
    return out


STYLES = {"llama": 0, "float32": 1, "gemma": 2}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, style: str) -> torch.Tensor:
    """`layers.RMSNorm` of `style` over the last dimension, one program per row."""
    rows = _rows(x)
    n = rows.shape[1]
    if weight.shape != (n,):
        raise ValueError(f"rms_norm: weight must be [{n}], got {tuple(weight.shape)}")
    out_dtype = torch.promote_types(weight.dtype, x.dtype) if style == "llama" else x.dtype
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    _per_row(kernels.rms_norm_kernel, rows, (weight,), out, (eps,), STYLE=STYLES[style])
    return out.view(*x.shape[:-1], n)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    rows = _rows(x)
    out = _per_row(kernels.layer_norm_kernel, rows, (weight, bias), torch.empty_like(rows), (eps,))
    return out.view(x.shape)


def l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    rows = _rows(x)
    out = _per_row(kernels.l2_normalize_kernel, rows, (), torch.empty_like(rows), (eps,))
    return out.view(x.shape)


def softmax(x: torch.Tensor, log: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Softmax (or log-softmax) over the last dimension, float32 inside, out in `dtype`."""
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=dtype or x.dtype, device=x.device)
    _per_row(kernels.softmax_kernel, rows, (), out, (), LOG=log)
    return out.view(x.shape)
