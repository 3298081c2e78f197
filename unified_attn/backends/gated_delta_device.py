"""The device side of `GatedDeltaStateBackend` on CUDA: the Mamba-2 convolution kernels and the
gated delta rule's (`backends/triton/gated_delta_ops.py`) over the step's slots, which are
Mamba-2's (`mamba_device.DeviceSlots`).

A decode step (one token per request) runs the one-token convolution and rule update; in a
CUDA graph its slots come from the persistent `seq_lens` and block tables (`device_slots`).
Other steps run the varlen convolution and the varlen rule over every request at once
(`gated_delta_chunked_varlen`'s "auto"). Checkpoints ("all" mode's block boundaries, a verify
step's state per token) are planned on a grid of 64 positions when every one falls on it (the
chunked WY form's chunk ends: "auto" takes that form), else on a grid of one row
(`CHECKPOINT_GRID`: the token-by-token kernel saves a state after any row), so they never
send a step to the torch path.
"""

from __future__ import annotations

import torch

from unified_attn.backend.state_layers import GatedDeltaWeights
from unified_attn.backends.state_slots import DeviceSlots, conv_windows

CHECKPOINT_GRID = 1  # the token-by-token kernel's grid: entry j, the state after j + 1 rows
CHUNKED_GRID = 64  # the chunked form's (its chunks end at multiples of 64 positions)

# (key heads, key head size, value heads, value head size)
Shape = tuple[int, int, int, int]


def decay_and_rate(
    a: torch.Tensor, b: torch.Tensor, weights: GatedDeltaWeights
) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b `[T, Hv]` (before the softplus and the sigmoid) -> g (log decay), beta float32."""
    g = weights.A * torch.nn.functional.softplus(a.float() + weights.dt_bias)
    return g, b.sigmoid().float()


def decode(
    qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, weights: GatedDeltaWeights,
    convs: torch.Tensor, states: torch.Tensor, slots: DeviceSlots, shape: Shape,
) -> torch.Tensor:  # fmt: skip
    """One token per request: qkv `[R, conv_dim]`, g and beta `[R, Hv]` -> o `[R, Hv, Dv]`."""
    from unified_attn.backends.triton.gated_delta_ops import gated_delta_update
    from unified_attn.backends.triton.ssm_ops import causal_conv1d_update

    conv = causal_conv1d_update(qkv, convs, slots.read, slots.write, weights.conv_weight,
                                weights.conv_bias)  # fmt: skip
    q, k, v = _split(conv, shape)
    return gated_delta_update(q, k, v, g, beta, states, slots.read, slots.write,
                              shape[1] ** -0.5, l2norm=True)  # fmt: skip


def varlen(
    qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, weights: GatedDeltaWeights,
    convs: torch.Tensor, states: torch.Tensor, slots: DeviceSlots,
    query_start_loc: torch.Tensor, shape: Shape,
) -> torch.Tensor:  # fmt: skip
    """Every request's rows: qkv `[T, conv_dim]`, g and beta `[T, Hv]` -> o `[T, Hv, Dv]`."""
    from unified_attn.backends.triton.gated_delta_ops import gated_delta_chunked_varlen
    from unified_attn.backends.triton.ssm_ops import causal_conv1d_varlen

    assert slots.offsets is not None
    before = conv_windows(qkv, convs, slots) if slots.conv_checkpoints else None
    conv = causal_conv1d_varlen(qkv, query_start_loc, convs, slots.read, slots.write,
                                weights.conv_weight, weights.conv_bias)  # fmt: skip
    q, k, v = _split(conv, shape)
    o = gated_delta_chunked_varlen(
        q, k, v, g, beta, query_start_loc, slots.offsets, states, slots.read, slots.write,
        shape[1] ** -0.5, slots.checkpoint_grid, slots.checkpoints, l2norm=True,
    )  # fmt: skip
    if before is not None:
        for (_, _, block, _), inputs in zip(slots.conv_checkpoints, before, strict=True):
            convs[block] = inputs
    return o


def _split(conv: torch.Tensor, shape: Shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The convolved `[q, k, v]` rows as q, k `[T, Hk, Dk]` and v `[T, Hv, Dv]` views."""
    key_heads, key_size, heads, head_size = shape
    key_dim = key_heads * key_size
    q, k, v = conv.split([key_dim, key_dim, heads * head_size], dim=-1)
    rows = conv.shape[0]
    return (q.view(rows, key_heads, key_size), k.view(rows, key_heads, key_size),
            v.view(rows, heads, head_size))  # fmt: skip
