"""The gated activation kernel (`kernels/layers/activation.py`; CPU: the interpreter) against the
torch MLP's `act(gate) * up` (`models.mlp`), which the model runs off CUDA and the HF parity tests
check against transformers."""

from __future__ import annotations

import pytest
import torch

from unified_attn.kernels.layers.activation import act_and_mul
from unified_attn.models.mlp import ACTIVATIONS, KERNEL_ACTIVATIONS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter's numpy exp warns where a gate's exponential overflows to inf (as intended)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def reference(gate_up: torch.Tensor, kind: str) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return ACTIVATIONS[kind](gate) * up


def assert_float32_close(got: torch.Tensor, gate_up: torch.Tensor, kind: str) -> None:
    """Within 1e-5 of torch relatively, plus, for GeGLU, 2e-7 of |gate * up|: torch's `1 +
    tanh(inner)` cancels in the negative tail (0 for gates below about -5, where the kernel's
    `gate * sigmoid(2 * inner)` keeps the small true value)."""
    gate, up = gate_up.chunk(2, dim=-1)
    slack = 2e-7 * (gate * up).abs() if kind == "geglu" else 1e-6
    want = reference(gate_up, kind)
    assert ((got - want).abs() <= 1e-5 * want.abs() + slack).all()


@pytest.mark.parametrize("kind", ["swiglu", "geglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("tokens", "width"), [(7, 40), (1, 96), (3, 1500)])
def test_act_and_mul_matches_the_torch_mlp(kind, dtype, tokens, width):
    gen = torch.Generator().manual_seed(width)
    gate_up = (4 * torch.randn(tokens, 2 * width, generator=gen)).to(dtype).to(DEVICE)
    got = act_and_mul(gate_up, KERNEL_ACTIVATIONS[kind])
    want = reference(gate_up, kind)
    assert got.dtype == dtype and got.shape == (tokens, width)
    if dtype == torch.float32:
        assert_float32_close(got, gate_up, kind)
    else:  # one rounding apart at most
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_a_strided_input_and_extreme_gates():
    # the gate/up columns of a wider buffer; gates far into both tails (exp overflows to inf)
    buffer = torch.randn(4, 3 * 48, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    buffer[:, :4] = torch.tensor([-100.0, 100.0, -30.0, 0.0], device=DEVICE)
    gate_up = buffer[:, : 2 * 48]
    for kind in ("swiglu", "geglu"):
        got = act_and_mul(gate_up, KERNEL_ACTIVATIONS[kind])
        assert torch.isfinite(got).all()
        assert_float32_close(got, gate_up, kind)


@pytest.mark.parametrize(
    ("gate_up", "activation", "message"),
    [
        (torch.zeros(2, 7), "silu", r"gate_up must be \[T, 2I\] \(an even width\), got \(2, 7\)"),
        (torch.zeros(2, 2, 8), "silu", r"must be \[T, 2I\] .* got \(2, 2, 8\)"),
        (torch.zeros(2, 8, dtype=torch.int32), "silu", "must be one of .* got torch.int32"),
        (torch.zeros(2, 8), "relu", "activation must be one of .* got 'relu'"),
    ],
)
def test_bad_inputs_are_named(gate_up, activation, message):
    with pytest.raises(ValueError, match=message):
        act_and_mul(gate_up.to(DEVICE), activation)
