"""Launcher of the gated activation kernel (`activation_jit.py`): SiLU-and-mul (SwiGLU) and
tanh-GELU-and-mul (GeGLU) over a gate/up projection's `[T, 2I]` output. CUDA, or the CPU under
`TRITON_INTERPRET=1` (tests)."""

from __future__ import annotations

import torch
import triton

from unified_attn.kernels.launch import FastLaunch
from unified_attn.kernels.layers.activation_jit import act_and_mul_kernel as act_and_mul_kernel_jit
from unified_attn.kernels.pdl import pdl_enabled

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
BLOCK = 1024  # columns of one program

# past Triton's Python dispatch (kernels/launch.py)
act_and_mul_kernel = FastLaunch(act_and_mul_kernel_jit)


def act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """`act(gate) * up` `[T, I]` (a new tensor, gate_up's dtype) for gate_up `[T, 2I]` (the gate
    columns first; any row stride): `activation` "silu" or "gelu_tanh"."""
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"act_and_mul: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}"
        )
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(
            f"act_and_mul: gate_up must be [T, 2I] (an even width), got {tuple(gate_up.shape)}"
        )
    if gate_up.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"act_and_mul: gate_up must be one of {SUPPORTED_DTYPES}, got {gate_up.dtype}"
        )
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(tokens, width, dtype=gate_up.dtype, device=gate_up.device)
    if tokens and width:
        block = min(BLOCK, triton.next_power_of_2(width))
        act_and_mul_kernel[(tokens, triton.cdiv(width, block))](
            gate_up, out, gate_up.stride(0), width, ACT=ACTIVATIONS[activation], BLOCK=block,
            num_warps=4, launch_pdl=pdl_enabled(gate_up.device),
        )  # fmt: skip
    return out
