"""Launchers of the decode-row GEMM (`skinny_gemm_jit.py`): a linear layer over at most
`MAX_ROWS` rows, alone (`skinny_linear`), after the residual add and RMSNorm of a decoder layer
(`skinny_add_norm_linear`) or after the gated activation of an MLP (`skinny_act_linear`). Each is
one launch where the unfused path takes two. CUDA, or the CPU under `TRITON_INTERPRET=1`
(tests); `benchmarks/decode_gemm.py` measures them against cuBLAS and the unfused kernels."""

from __future__ import annotations

import torch
import triton

from unified_attn.kernels.layers.activation import ACTIVATIONS
from unified_attn.kernels.layers.norm import STYLES
from unified_attn.kernels.layers.skinny_gemm_jit import skinny_gemm_kernel

MAX_ROWS = 16  # BLOCK_M: decode batches up to 16 requests
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
Tiles = tuple[int, int, int, int]  # BLOCK_N, BLOCK_K, num_warps, num_stages


def skinny_tiles(n: int, k: int, dtype: torch.dtype) -> Tiles:
    """Per weight shape, from an H200 sweep at one row (bf16, Llama-3-8B's projections): 64
    columns for weights of 16k rows or more, else 32; chunks of 512 along K from 8k columns,
    else 256; 4 warps; 4 stages (3 with 64 columns); float32 halves the chunk."""
    block_n = 64 if n >= 16384 else 32
    block_k = 512 if k >= 8192 else 256
    stages = 3 if block_n == 64 else 4
    if dtype == torch.float32:
        block_k, stages = block_k // 2, 2
    return block_n, block_k, 4, stages


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    tiles: Tiles | None = None,
) -> torch.Tensor:  # fmt: skip
    """`x @ weight^T (+ bias)`: x `[M, K]` (M <= MAX_ROWS), weight `[N, K]` -> `[M, N]`."""
    _check("skinny_linear", x, x.shape[-1], weight, bias)
    y = x.new_empty(x.shape[0], weight.shape[0])
    _launch(x, weight, bias, y, None, None, None, 0.0, 0, "llama", "silu", tiles)
    return y


def skinny_add_norm_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    style: str, weight: torch.Tensor, bias: torch.Tensor | None = None,
    tiles: Tiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`(rms_norm(h) @ weight^T (+ bias), h)` with `h = x + residual` (x itself without a
    residual): `add_rms_norm` (or `rms_norm`) and the GEMM in one launch. x `[M, K]`,
    norm_weight `[K]` of x's dtype, `style` one of `norm.STYLES`."""
    op = "skinny_add_norm_linear"
    _check(op, x, x.shape[-1], weight, bias)
    if style not in STYLES:
        raise ValueError(f"{op}: style must be one of {sorted(STYLES)}, got {style!r}")
    if norm_weight.shape != (x.shape[1],) or norm_weight.dtype != x.dtype:
        raise ValueError(
            f"{op}: norm_weight must be [{x.shape[1]}] {x.dtype} like x, got "
            f"{tuple(norm_weight.shape)} {norm_weight.dtype}"
        )
    for name, t in (("x", x), ("residual", residual)):
        if t is not None and (t.shape != x.shape or t.dtype != x.dtype or not t.is_contiguous()):
            raise ValueError(
                f"{op}: {name} must be a contiguous {tuple(x.shape)} {x.dtype} tensor, got "
                f"{tuple(t.shape)} {t.dtype} strides {t.stride()}"
            )
    y = x.new_empty(x.shape[0], weight.shape[0])
    new_residual = x if residual is None else torch.empty_like(residual)
    _launch(x, weight, bias, y, residual, new_residual, norm_weight, eps, 1, style, "silu",
            tiles)  # fmt: skip
    return y, new_residual


def skinny_act_linear(
    gate_up: torch.Tensor, activation: str, weight: torch.Tensor,
    bias: torch.Tensor | None = None, tiles: Tiles | None = None,
) -> torch.Tensor:  # fmt: skip
    """`act_and_mul(gate_up, activation) @ weight^T (+ bias)` in one launch: gate_up `[M, 2K]`
    (the gate columns, then up), weight `[N, K]`."""
    op = "skinny_act_linear"
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {sorted(ACTIVATIONS)}, got "
                         f"{activation!r}")  # fmt: skip
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"{op}: gate_up must be [M, 2K], got {tuple(gate_up.shape)}")
    _check(op, gate_up, gate_up.shape[1] // 2, weight, bias)
    y = gate_up.new_empty(gate_up.shape[0], weight.shape[0])
    _launch(gate_up, weight, bias, y, None, None, None, 0.0, 2, "llama", activation, tiles)
    return y


def _check(
    op: str, x: torch.Tensor, k: int, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
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
                f"{op}: {name} must be {x.dtype} on {x.device} like x, got {t.dtype} on "
                f"{t.device}"
            )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"{op}: bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")


def _launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
    residual: torch.Tensor | None, new_residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None, eps: float, prologue: int, style: str, activation: str,
    tiles: Tiles | None,
) -> None:  # fmt: skip
    n, k = weight.shape
    block_n, block_k, num_warps, num_stages = tiles or skinny_tiles(n, k, x.dtype)
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    has_residual = residual is not None
    skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, weight, weight if bias is None else bias, y, residual if has_residual else x,
        new_residual if has_residual else x, weight if norm_weight is None else norm_weight,
        x.shape[0], n, k, eps, x.stride(0), weight.stride(0), y.stride(0),
        residual.stride(0) if residual is not None else x.stride(0),
        PROLOGUE=prologue, HAS_RESIDUAL=has_residual, STYLE=STYLES[style],
        ACT=ACTIVATIONS[activation], HAS_BIAS=bias is not None, BLOCK_M=MAX_ROWS,
        BLOCK_N=block_n, BLOCK_K=block_k, DOT="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
