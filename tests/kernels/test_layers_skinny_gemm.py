"""The decode-row GEMM (`kernels/layers/skinny_gemm.py`; CPU: the interpreter) against torch:
1 to 64 rows (blocks of 16, 32 and 64), widths that are not multiples of the tiles, bias, and
the inputs it refuses."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_layers_norm import rand
from unified_attn.kernels.layers.skinny_gemm import (
    MAX_ROWS,
    SHARED_BUDGET,
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
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40, MAX_ROWS])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear(dtype, rows, with_bias):
    x, w = rand(rows, K, dtype=dtype).to(DEVICE), weight(N, K, dtype)
    bias = weight(1, N, dtype, seed=3)[0] if with_bias else None
    assert_close(skinny_linear(x, w, bias, SMALL), matmul(x, w, bias))
    assert_close(skinny_linear(x, w, bias), matmul(x, w, bias))  # the default tiles


def test_default_tiles_follow_the_weight_shape():
    assert skinny_tiles(6144, 4096, torch.bfloat16) == (32, 256, 4, 4)
    assert skinny_tiles(28672, 4096, torch.bfloat16) == (64, 256, 4, 3)
    assert skinny_tiles(4096, 14336, torch.bfloat16) == (32, 512, 4, 4)
    assert skinny_tiles(4096, 14336, torch.float32) == (32, 256, 4, 2)
    assert skinny_tiles(4096, 4096, torch.bfloat16) == (32, 512, 4, 4)  # o: 128 programs


def test_blocks_of_more_rows_keep_the_staged_tiles_within_shared_memory():
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
        for dtype in (torch.bfloat16, torch.float32):
            for block_m in (16, 32, 64):
                block_n, block_k, _, stages = skinny_tiles(n, k, dtype, block_m)
                staged = stages * (block_m + block_n) * block_k * dtype.itemsize
                assert staged <= SHARED_BUDGET and block_k >= 64 and stages >= 2
    assert skinny_tiles(4096, 4096, torch.bfloat16, 64) == (32, 256, 4, 4)  # K chunk first
    assert skinny_tiles(28672, 4096, torch.bfloat16, 64) == (64, 256, 4, 3)


def test_refuses_what_it_cannot_take():
    x, w = torch.zeros(MAX_ROWS + 1, K, device=DEVICE), weight(N, K, torch.float32)
    with pytest.raises(ValueError, match=r"1 <= M <= 64 .*larger batches take the library GEMM"):
        skinny_linear(x, w)
    with pytest.raises(ValueError, match=r"weight must be \[N, 80\]"):
        skinny_linear(x[:2], w[:, :40])
    with pytest.raises(ValueError, match=r"weight must be torch\.float32"):
        skinny_linear(x[:2], w.half())
