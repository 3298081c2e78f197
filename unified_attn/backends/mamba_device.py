"""The device side of `Mamba2StateBackend` on CUDA: per-step slot tensors and the Triton
kernels (`backends/triton/ssm_ops.py`).

A decode step (one token per request) runs the one-token convolution and state update, and in
a CUDA graph its slots are computed on the device from the persistent `seq_lens` and block
tables (`device_slots`), so the plan is captured with the forward. Other steps run the varlen
convolution and the chunked scan over every request at once; "all" mode's checkpoints go to
the scan's `checkpoint_slots` (and, for the convolution's carried inputs, are copied here).
"""

from __future__ import annotations

import torch

from unified_attn.backend.state_layers import Mamba2Weights
from unified_attn.backends.state_slots import DeviceSlots, conv_windows


def decode(
    xbc: torch.Tensor, dt: torch.Tensor, weights: Mamba2Weights, convs: torch.Tensor,
    ssms: torch.Tensor, slots: DeviceSlots, shape: tuple[int, int, int, int],
    limit: tuple[float, float],
) -> torch.Tensor:  # fmt: skip
    """One token per request: xbc `[R, conv_dim]`, dt `[R, H]` -> y `[R, H, P]`."""
    from unified_attn.backends.triton.ssm_ops import causal_conv1d_update, ssd_state_update

    conv = causal_conv1d_update(xbc, convs, slots.read, slots.write, weights.conv_weight,
                                weights.conv_bias)  # fmt: skip
    x, B, C = _split(conv, shape)
    return ssd_state_update(x, dt, weights.dt_bias.float(), weights.A, B, C, weights.D.float(),
                            ssms, slots.read, slots.write, limit)  # fmt: skip


def varlen(
    xbc: torch.Tensor, dt: torch.Tensor, weights: Mamba2Weights, convs: torch.Tensor,
    ssms: torch.Tensor, slots: DeviceSlots, query_start_loc: torch.Tensor,
    shape: tuple[int, int, int, int], chunk_size: int, limit: tuple[float, float],
) -> torch.Tensor:  # fmt: skip
    """Every request's rows: xbc `[T, conv_dim]`, dt `[T, H]` -> y `[T, H, P]`."""
    from unified_attn.backends.triton.ssm_ops import causal_conv1d_varlen, ssd_scan_varlen

    assert slots.offsets is not None
    before = conv_windows(xbc, convs, slots) if slots.conv_checkpoints else None
    conv = causal_conv1d_varlen(xbc, query_start_loc, convs, slots.read, slots.write,
                                weights.conv_weight, weights.conv_bias)  # fmt: skip
    x, B, C = _split(conv, shape)
    y = ssd_scan_varlen(x, dt, weights.dt_bias.float(), weights.A, B, C, weights.D.float(),
                        query_start_loc, slots.offsets, ssms, slots.read, slots.write,
                        chunk_size, limit, slots.checkpoints)  # fmt: skip
    if before is not None:
        for (_, _, block, _), inputs in zip(slots.conv_checkpoints, before, strict=True):
            convs[block] = inputs
    return y


def _split(
    conv: torch.Tensor, shape: tuple[int, int, int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    heads, head_size, groups, state = shape
    x, B, C = conv.split([heads * head_size, groups * state, groups * state], dim=-1)
    rows = conv.shape[0]
    return (x.view(rows, heads, head_size), B.view(rows, groups, state),
            C.view(rows, groups, state))  # fmt: skip
