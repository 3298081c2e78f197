"""The decode-row GEMM (`kernels/layers/skinny_gemm.py`; CPU: the interpreter) against torch:
alone, after the residual add and RMSNorm (the torch layer `models.layers.RMSNorm` in every
style; the new residual bitwise torch's sum), after the gated activation (the torch MLP's
rounding); 1 to 16 rows, widths that are not multiples of the tiles, bias, and the inputs it
refuses."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_layers_norm import make_norm, rand
from unified_attn.kernels.layers.skinny_gemm import (
    MAX_ROWS,
    skinny_act_linear,
    skinny_add_norm_linear,
    skinny_linear,
    skinny_tiles,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]
SMALL = (16, 32, 4, 2)  # BLOCK_N, BLOCK_K, warps, stages: several programs and K chunks
N, K = 48, 80  # neither a multiple of the small tiles


def weight(n: int, k: int, dtype: torch.dtype, seed: int = 2) -> torch.Tensor:
    return (0.1 * rand(n, k, dtype=torch.float32, seed=seed)).to(dtype).to(DEVICE)


def matmul(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The reference GEMM: float32 products of the same inputs, rounded once."""
    y = a.float() @ w.float().t()
    return (y if bias is None else y + bias.float()).to(a.dtype)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # float32 accumulation in another order, one rounding of the output
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear(dtype, rows, with_bias):
    x, w = rand(rows, K, dtype=dtype).to(DEVICE), weight(N, K, dtype)
    bias = weight(1, N, dtype, seed=3)[0] if with_bias else None
    assert_close(skinny_linear(x, w, bias, SMALL), matmul(x, w, bias))
    assert_close(skinny_linear(x, w, bias), matmul(x, w, bias))  # the default tiles


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", ["llama", "float32", "gemma"])
@pytest.mark.parametrize("rows", [1, 5, MAX_ROWS])
def test_add_norm_linear_is_add_rms_norm_then_the_gemm(dtype, style, rows):
    norm = make_norm(K, style, dtype)
    x = rand(rows, K, dtype=dtype, seed=4).to(DEVICE)
    residual = rand(rows, K, dtype=dtype, seed=5).to(DEVICE)
    w = weight(N, K, dtype)
    y, new_residual = skinny_add_norm_linear(x, residual, norm.weight, norm.eps, style, w,
                                             tiles=SMALL)  # fmt: skip
    assert torch.equal(new_residual, x + residual)
    assert_close(y, matmul(norm(x + residual), w, None))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norm_linear_without_a_residual_returns_x(dtype):
    """The first layer: no residual yet; x is the residual after it (no copy)."""
    norm = make_norm(K, "llama", dtype)
    x, w = rand(2, K, dtype=dtype, seed=6).to(DEVICE), weight(N, K, dtype)
    y, new_residual = skinny_add_norm_linear(x, None, norm.weight, norm.eps, "llama", w,
                                             tiles=SMALL)  # fmt: skip
    assert new_residual is x
    assert_close(y, matmul(norm(x), w, None))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_act_linear_is_the_gated_activation_then_the_gemm(dtype, activation):
    gate_up = rand(4, 2 * K, dtype=dtype, seed=7).to(DEVICE)
    gate, up = gate_up.float().chunk(2, dim=-1)
    if activation == "silu":
        act = torch.nn.functional.silu(gate)
    else:
        act = torch.nn.functional.gelu(gate, approximate="tanh")
    product = (act.to(dtype).float() * up).to(dtype)  # the MLP's roundings
    w = weight(N, K, dtype)
    assert_close(skinny_act_linear(gate_up, activation, w, tiles=SMALL), matmul(product, w, None))


def test_default_tiles_follow_the_weight_shape():
    assert skinny_tiles(6144, 4096, torch.bfloat16) == (32, 256, 4, 4)
    assert skinny_tiles(28672, 4096, torch.bfloat16) == (64, 256, 4, 3)
    assert skinny_tiles(4096, 14336, torch.bfloat16) == (32, 512, 4, 4)
    assert skinny_tiles(4096, 14336, torch.float32) == (32, 256, 4, 2)


def test_refuses_what_it_cannot_take():
    x, w = torch.zeros(MAX_ROWS + 1, K, device=DEVICE), weight(N, K, torch.float32)
    with pytest.raises(ValueError, match=r"1 <= M <= 16 .*larger batches take the library GEMM"):
        skinny_linear(x, w)
    with pytest.raises(ValueError, match=r"weight must be \[N, 80\]"):
        skinny_linear(x[:2], w[:, :40])
    with pytest.raises(ValueError, match=r"weight must be torch\.float32"):
        skinny_linear(x[:2], w.half())
    norm_w = torch.ones(K, device=DEVICE)
    with pytest.raises(ValueError, match="style must be one of"):
        skinny_add_norm_linear(x[:2], None, norm_w, 1e-6, "rms", w)
    with pytest.raises(ValueError, match="residual must be a contiguous"):
        skinny_add_norm_linear(x[:2], x[:3], norm_w, 1e-6, "llama", w)
    with pytest.raises(ValueError, match="norm_weight must be"):
        skinny_add_norm_linear(x[:2], None, norm_w.half(), 1e-6, "llama", w)
    with pytest.raises(ValueError, match="activation must be one of"):
        skinny_act_linear(torch.zeros(2, 2 * K, device=DEVICE), "relu", w)
