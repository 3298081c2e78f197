"""Gated activation kernel (launcher: `activation.py`): `act(gate) * up` from the concatenated
`[T, 2I]` output of a gate/up projection, rounded as `models.mlp.MLP` in torch: the activation in
float32, rounded to the input dtype, then the product, rounded again."""

from __future__ import annotations

import triton
import triton.language as tl

from unified_attn.kernels.pdl_jit import pdl_start

# constexpr: a compiled kernel can read only constexpr globals (the interpreter reads any)
GELU_TANH_BETA = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
GELU_TANH_KAPPA = tl.constexpr(0.044715)


@triton.jit
def _activate(g, ACT: tl.constexpr):
    """0: SiLU `g * sigmoid(g)`; 1: tanh-approximated GELU, `g * sigmoid(2 * inner)`, which is
    `0.5 * g * (1 + tanh(inner))` without the cancellation near -1."""
    if ACT == 0:
        return g / (1.0 + tl.exp(-g))
    else:
        inner = GELU_TANH_BETA * (g + GELU_TANH_KAPPA * g * g * g)
        return g / (1.0 + tl.exp(-2.0 * inner))


@triton.jit
def act_and_mul_kernel(
    gate_up_ptr,  # [T, 2 * width]: the gate columns, then the up columns; last dim contiguous
    out_ptr,  # [T, width] contiguous
    stride_in,
    width,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
    launch_pdl: tl.constexpr = False,  # kernels/pdl.py
):
    pdl_start(launch_pdl)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=ok, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + width + cols, mask=ok, other=0.0)
    act = _activate(gate.to(tl.float32), ACT).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=ok)
