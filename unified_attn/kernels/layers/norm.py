"""Launchers of the RMSNorm kernels (`norm_jit.py`): plain (`rms_norm`) and with the residual
add before it (`add_rms_norm`), in the styles of `models.layers.RMSNorm`. CUDA, or the CPU
under `TRITON_INTERPRET=1` (tests)."""

from __future__ import annotations

import attrs
import torch
import triton

from unified_attn.kernels.launch import FastLaunch
from unified_attn.kernels.layers.norm_jit import rms_norm_kernel as rms_norm_kernel_jit
from unified_attn.kernels.pdl import pdl_enabled

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
STYLES = {"llama": 0, "float32": 1, "gemma": 2}  # models.config.NormStyle
MAX_BLOCK = 16384  # the widest row a program holds in registers; wider rows go in chunks
CHUNK = 4096  # the chunk of a wider row
TILE = 4096  # elements of a program over short rows: TILE // width rows each

# past Triton's Python dispatch (kernels/launch.py)
rms_norm_kernel = FastLaunch(rms_norm_kernel_jit)


@attrs.frozen
class NormTile:
    """What one program covers: `rows` rows of `block` lanes, or (`chunked`) one row in
    chunks of `block`."""

    rows: int
    block: int
    chunked: bool
    num_warps: int


def norm_tile(width: int, max_block: int = MAX_BLOCK) -> NormTile:
    """The tile of rows `width` wide: the whole row when its next power of two is at most
    `max_block`, as many rows as fill TILE lanes; else one row in chunks."""
    block = triton.next_power_of_2(width)
    if block > max_block:
        return NormTile(rows=1, block=min(CHUNK, max_block), chunked=True, num_warps=8)
    rows = max(1, TILE // block)
    return NormTile(rows, block, chunked=False, num_warps=min(16, max(4, rows * block // 512)))


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, style: str, tile: NormTile | None = None
) -> torch.Tensor:
    """`RMSNorm(style)` of x `[..., N]` (any strides; up to three dimensions without a copy)
    with `weight [N]`: a new contiguous tensor (dtype: x's, or its promotion with the
    weight's in the llama style, as the torch layer). `tile` overrides `norm_tile`."""
    _check(x, weight, eps, style)
    rows = _rows3(x)
    out = torch.empty(x.shape, dtype=_out_dtype(x, weight, style), device=x.device)
    _launch(rows, weight, out, None, None, eps, style, tile)
    return out


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    style: str,
    tile: NormTile | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(x + residual), x + residual)` in one pass, x and residual `[T, N]` of one
    dtype (the sum rounded to it before the norm, as torch adds); both results new tensors."""
    _check(x, weight, eps, style)
    if x.dim() != 2 or residual.shape != x.shape:
        raise ValueError(
            f"add_rms_norm: x and residual must both be [T, N]; got x {tuple(x.shape)} and "
            f"residual {tuple(residual.shape)}"
        )
    if residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(
            f"add_rms_norm: residual must be {x.dtype} on {x.device} like x, got "
            f"{residual.dtype} on {residual.device}"
        )
    residual = _last_contiguous(residual)
    out = torch.empty(x.shape, dtype=_out_dtype(x, weight, style), device=x.device)
    residual_out = torch.empty_like(residual)
    _launch(_rows3(x), weight, out, residual, residual_out, eps, style, tile)
    return out, residual_out


def _check(x: torch.Tensor, weight: torch.Tensor, eps: float, style: str) -> None:
    if style not in STYLES:
        raise ValueError(f"rms_norm: style must be one of {sorted(STYLES)}, got {style!r}")
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"rms_norm: {name} must be one of {SUPPORTED_DTYPES}, got {t.dtype}")
    if x.dim() == 0 or weight.shape != (x.shape[-1],) or weight.device != x.device:
        raise ValueError(
            f"rms_norm: weight must be [N] on x's device for x [..., N]; got x "
            f"{tuple(x.shape)} on {x.device}, weight {tuple(weight.shape)} on {weight.device}"
        )
    if not eps > 0:
        raise ValueError(f"rms_norm: eps must be positive, got {eps}")


def _out_dtype(x: torch.Tensor, weight: torch.Tensor, style: str) -> torch.dtype:
    return torch.promote_types(weight.dtype, x.dtype) if style == "llama" else x.dtype


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def _rows3(x: torch.Tensor) -> torch.Tensor:
    """x as `[outer, inner, N]` with a contiguous last dimension (a copy only when needed)."""
    x = _last_contiguous(x)
    if x.dim() > 3:
        x = x.reshape(-1, *x.shape[-2:])
    while x.dim() < 3:
        x = x.unsqueeze(-2)
    return x


def _launch(
    rows: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    residual: torch.Tensor | None,
    residual_out: torch.Tensor | None,
    eps: float,
    style: str,
    tile: NormTile | None,
) -> None:
    """One program per `tile.rows` rows of `rows [outer, inner, N]`, into `out [R, N]`."""
    outer, inner, width = rows.shape
    num_rows = outer * inner
    if num_rows == 0 or width == 0:
        return
    t = tile or norm_tile(width)
    r = out if residual is None else residual  # placeholders when there is no residual
    r_out = out if residual_out is None else residual_out
    rms_norm_kernel[(triton.cdiv(num_rows, t.rows),)](
        rows, weight.contiguous(), out, r, r_out, num_rows, inner, rows.stride(0),
        rows.stride(1), r.stride(0), r_out.stride(0), width, eps,
        HAS_RESIDUAL=residual is not None, STYLE=STYLES[style], ROWS=t.rows, BLOCK=t.block,
        CHUNKED=t.chunked, num_warps=t.num_warps, launch_pdl=pdl_enabled(rows.device),
    )  # fmt: skip
