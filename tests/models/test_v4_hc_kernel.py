"""DeepSeek-V4's hyper-connection weights in one Triton launch
(`kernels/hyper/hyper_connections.py`; CPU: the interpreter) against the torch reference
`deepseek_v4_layers.hc_weights`, which the model runs off CUDA and the HF parity tests check
against transformers."""

from __future__ import annotations

import pytest
import torch

from unified_attn.kernels.hyper.hyper_connections import hc_weights as hc_weights_kernel
from unified_attn.kernels.hyper.hyper_connections import serves_width
from unified_attn.models.deepseek_v4_layers import hc_weights

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    ("tokens", "n", "param_dtype"),
    [(5, 4, torch.float32), (70, 4, torch.float16), (33, 2, torch.float32), (3, 8, torch.float32)],
)
def test_the_kernel_gives_the_reference_weights(tokens, n, param_dtype):
    gen = torch.Generator().manual_seed(n + tokens)
    width = (2 + n) * n
    mixes = (torch.randn(tokens, width, generator=gen) * 3).to(DEVICE)
    base = torch.randn(width, generator=gen).to(param_dtype).to(DEVICE)
    scale = torch.rand(3, generator=gen).to(param_dtype).to(DEVICE) * 2
    want = hc_weights(mixes, base, scale, 1e-6, 20)
    got = hc_weights_kernel(mixes, base, scale, 1e-6, 20)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    comb = got[2]  # doubly stochastic after the rounds: every column sums to 1, rows nearly
    torch.testing.assert_close(comb.sum(dim=1), torch.ones(tokens, n, device=DEVICE), atol=1e-4,
                               rtol=0)  # fmt: skip


def test_widths_the_kernel_does_not_serve_are_named():
    assert serves_width(24) == 4 and serves_width(15) is None  # N = 3: not a power of two
    with pytest.raises(ValueError, match=r"mixes must be \[T, \(2 \+ N\) \* N\] float32 .* "
                                         r"got \(2, 15\) torch.float32"):  # fmt: skip
        hc_weights_kernel(torch.zeros(2, 15), torch.zeros(15), torch.zeros(3), 1e-6, 3)
