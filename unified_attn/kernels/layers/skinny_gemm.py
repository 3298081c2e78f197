"""Launcher of the decode-row GEMM (`skinny_gemm_jit.py`): a linear layer over at most
`MAX_ROWS` rows (`skinny_linear`), the weight read once with no split-K reduction. CUDA, or the
CPU under `TRITON_INTERPRET=1` (tests); `benchmarks/decode_gemm.py` measures it against cuBLAS."""

from __future__ import annotations

import torch
import triton

from unified_attn.kernels.launch import FastLaunch
from unified_attn.kernels.layers.skinny_gemm_jit import skinny_gemm_kernel as skinny_gemm_kernel_jit
from unified_attn.kernels.pdl import pdl_enabled

MAX_ROWS = 64  # the largest BLOCK_M: decode batches up to 64 requests
SHARED_BUDGET = 200 * 1024  # bytes of staged x and weight tiles per program (sm90: 227 KiB)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
Tiles = tuple[int, int, int, int]  # BLOCK_N, BLOCK_K, num_warps, num_stages

# past Triton's Python dispatch (kernels/launch.py)
skinny_gemm_kernel = FastLaunch(skinny_gemm_kernel_jit)


def skinny_tiles(n: int, k: int, dtype: torch.dtype, block_m: int = 16) -> Tiles:
    """Per weight shape, from H200 sweeps (bf16, Llama-3-8B's projections,
    `benchmarks/tune_skinny_gemm.py`): 64 columns for weights of 16k rows or more, else 32;
    chunks of 512 along K for weights of 8k+ columns or at most 4k rows (o and down: 128
    programs, each with more bytes in flight), else 256; 4 warps; 4 stages (3 with 64
    columns); float32 halves the chunk. Blocks of more rows then give up K chunk (down to 256)
    and stages (down to 2) until the staged tiles fit `SHARED_BUDGET`."""
    block_n = 64 if n >= 16384 else 32
    block_k = 512 if k >= 8192 or n <= 4096 else 256
    stages = 3 if block_n == 64 else 4
    if dtype == torch.float32:
        block_k, stages = block_k // 2, 2
    while stages * (block_m + block_n) * block_k * dtype.itemsize > SHARED_BUDGET:
        if block_k > 256:
            block_k //= 2
        elif stages > 2:
            stages -= 1
        else:
            block_k //= 2
    return block_n, block_k, 4, stages


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    tiles: Tiles | None = None,
) -> torch.Tensor:  # fmt: skip
    """`x @ weight^T (+ bias)`: x `[M, K]` (M <= MAX_ROWS), weight `[N, K]` -> `[M, N]`."""
    _check(x, weight, bias)
    y = x.new_empty(x.shape[0], weight.shape[0])
    _launch(x, weight, bias, y, tiles)
    return y


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    op, k = "skinny_linear", x.shape[-1]
    if x.dim() != 2 or not 0 < x.shape[0] <= MAX_ROWS or x.stride(1) != 1:
        raise ValueError(
            f"{op}: x must be [M, K] with 1 <= M <= {MAX_ROWS} and contiguous rows, got "
            f"{tuple(x.shape)} strides {x.stride()}; larger batches take the library GEMM"
        )
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{op}: x must be one of {SUPPORTED_DTYPES}, got {x.dtype}")
    if weight.dim() != 2 or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(
            f"{op}: weight must be [N, {k}] with contiguous rows, got {tuple(weight.shape)} "
            f"strides {weight.stride()}"
        )
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise ValueError(
                f"{op}: {name} must be {x.dtype} on {x.device} like x, got {t.dtype} on {t.device}"
            )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"{op}: bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")


def _launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
    tiles: Tiles | None,
) -> None:  # fmt: skip
    n, k = weight.shape
    block_m = max(16, triton.next_power_of_2(x.shape[0]))
    block_n, block_k, num_warps, num_stages = tiles or skinny_tiles(n, k, x.dtype, block_m)
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, weight, weight if bias is None else bias, y, x.shape[0], n, k, x.stride(0),
        weight.stride(0), y.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, DOT="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl_enabled(x.device),
    )  # fmt: skip
