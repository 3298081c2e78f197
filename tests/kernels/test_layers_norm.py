"""The RMSNorm kernels (`kernels/layers/norm.py`; CPU: the interpreter) against the torch layer
`models.layers.RMSNorm`, which the model runs off CUDA and the HF parity tests check against
transformers: every style, odd widths, strided and 3-D inputs, chunked rows, the residual add."""

from __future__ import annotations

import pytest
import torch

from unified_attn.kernels.layers.norm import NormTile, add_rms_norm, norm_tile, rms_norm
from unified_attn.models.layers import RMSNorm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
STYLES = ["llama", "float32", "gemma"]
DTYPES = [torch.float32, torch.float16]
# odd widths, several rows per program, one row per program (4096), 3-D and 4-D inputs
SHAPES = [(5, 40), (1, 96), (3, 7, 96), (2, 300), (4, 2, 3, 40), (2, 4096)]
CHUNKED = NormTile(rows=1, block=32, chunked=True, num_warps=4)  # rows longer than a block


def make_norm(width: int, style: str, dtype: torch.dtype, seed: int = 0) -> RMSNorm:
    norm = RMSNorm(width, 1e-6, style)
    gen = torch.Generator().manual_seed(seed)
    norm.weight.data = (1 + 0.5 * torch.randn(width, generator=gen)).to(dtype).to(DEVICE)
    return norm


def rand(*shape: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return (2 * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # one rounding of the output apart at most
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tile", [None, CHUNKED], ids=["rows", "chunked"])
def test_rms_norm_matches_the_torch_layer(style, dtype, shape, tile):
    norm = make_norm(shape[-1], style, dtype)
    x = rand(*shape, dtype=dtype).to(DEVICE)
    assert_close(rms_norm(x, norm.weight, norm.eps, style, tile), norm(x))


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tile", [None, CHUNKED], ids=["rows", "chunked"])
def test_add_rms_norm_adds_as_torch_then_norms(style, dtype, tile):
    norm = make_norm(96, style, dtype)
    x, residual = (rand(6, 96, dtype=dtype, seed=s).to(DEVICE) for s in (1, 2))
    out, new_residual = add_rms_norm(x, residual, norm.weight, norm.eps, style, tile)
    assert torch.equal(new_residual, x + residual)  # the model's residual stream, bit for bit
    assert_close(out, norm(x + residual))
    assert torch.equal(residual, rand(6, 96, dtype=dtype, seed=2).to(DEVICE))  # not in place


def test_strided_heads_norm_without_a_copy_of_the_input():
    # q of a packed q/k/v output: [T, H, D] with a token stride wider than H * D (Qwen 3)
    norm = make_norm(40, "llama", torch.float32)
    qkv = rand(5, 3 * 4 * 40, dtype=torch.float32).to(DEVICE)
    q = qkv[:, : 4 * 40].view(5, 4, 40)
    got = rms_norm(q, norm.weight, norm.eps, "llama")
    assert got.is_contiguous()
    assert_close(got, norm(q))


def test_llama_style_promotes_to_the_weight_dtype_as_torch():
    norm = make_norm(40, "llama", torch.float32)
    x = rand(3, 40, dtype=torch.float16).to(DEVICE)
    got = rms_norm(x, norm.weight, norm.eps, "llama")
    assert got.dtype == torch.float32
    assert_close(got, norm(x))


def test_wide_rows_go_in_chunks_and_match():
    assert norm_tile(16384).chunked is False and norm_tile(16385).chunked is True
    assert norm_tile(40).rows * norm_tile(40).block == 4096  # short rows share a program
    norm = make_norm(20000, "llama", torch.float32)
    x = rand(2, 20000, dtype=torch.float32).to(DEVICE)
    assert_close(rms_norm(x, norm.weight, norm.eps, "llama"), norm(x))


def test_no_rows_is_fine():
    norm = make_norm(40, "llama", torch.float32)
    assert rms_norm(torch.zeros(0, 40, device=DEVICE), norm.weight, 1e-6, "llama").shape == (0, 40)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda x, w: rms_norm(x, w, 1e-6, "rms"), "style must be one of .* got 'rms'"),
        (lambda x, w: rms_norm(x.int(), w, 1e-6, "llama"), "x must be one of .* got torch.int32"),
        (lambda x, w: rms_norm(x, w[:8], 1e-6, "llama"), r"weight must be \[N\] .* \(8,\)"),
        (lambda x, w: rms_norm(x, w, 0.0, "llama"), "eps must be positive, got 0.0"),
        (
            lambda x, w: add_rms_norm(x, x[:2], w, 1e-6, "llama"),
            r"x and residual must both be \[T, N\]; got x \(3, 40\) and residual \(2, 40\)",
        ),
        (
            lambda x, w: add_rms_norm(x, x.half(), w, 1e-6, "llama"),
            "residual must be torch.float32 .* got torch.float16",
        ),
    ],
)
def test_bad_inputs_are_named(call, message):
    x, w = torch.zeros(3, 40, device=DEVICE), torch.ones(40, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        call(x, w)
