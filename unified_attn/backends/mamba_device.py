"""The device side of `Mamba2StateBackend` on CUDA: per-step slot tensors and the Triton
kernels (`backends/triton/ssm_ops.py`).

A decode step (one token per request) runs the one-token convolution and state update, and in
a CUDA graph its slots are computed on the device from the persistent `seq_lens` and block
tables (`device_slots`), so the plan is captured with the forward. Other steps run the varlen
convolution and the chunked scan over every request at once; "all" mode's checkpoints go to
the scan's `checkpoint_slots` (and, for the convolution's carried inputs, are copied here).
"""

from __future__ import annotations

import attrs
import torch

from unified_attn.backend.state_layers import Mamba2Weights
from unified_attn.backends.state_rows import StateRow


@attrs.frozen
class DeviceSlots:
    """A group's slots for one step, all int32 on the device."""

    read: torch.Tensor  # [R] block holding the state before the step, -1: zeros
    write: torch.Tensor  # [R] block receiving the state after it, -1: none (padding)
    offsets: torch.Tensor | None = None  # [R] tokens before the step (varlen steps)
    # [R, M]: the scan's checkpoint entries ("all" mode), None without checkpoints
    checkpoints: torch.Tensor | None = None
    # host, per checkpoint: (request's first row, rows before the checkpoint, block, block
    # read at the step's start or -1)
    conv_checkpoints: tuple[tuple[int, int, int, int], ...] = ()


def host_slots(
    rows: list[StateRow], chunk_size: int, device: torch.device
) -> DeviceSlots | None:
    """The slots of a step planned on the host; None when a checkpoint is not on a multiple of
    `chunk_size` (the scan only saves states at its chunk ends: the torch path runs)."""
    entries: list[list[int]] = []
    conv: list[tuple[int, int, int, int]] = []
    for row in rows:
        first = row.offset // chunk_size + 1
        row_entries: list[int] = []
        for done, block in row.checkpoints:
            position = row.offset + done
            if position % chunk_size:
                return None
            index = position // chunk_size - first
            row_entries += [-1] * (index - len(row_entries)) + [block]
            conv.append((row.start, done, block, -1 if row.read is None else row.read))
        entries.append(row_entries)
    width = max((len(e) for e in entries), default=0)

    def ints(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)

    return DeviceSlots(
        read=ints([-1 if r.read is None else r.read for r in rows]),
        write=ints([r.write for r in rows]),
        offsets=ints([r.offset for r in rows]),
        checkpoints=ints([e + [-1] * (width - len(e)) for e in entries]) if width else None,
        conv_checkpoints=tuple(conv),
    )


def device_slots(
    seq_lens: torch.Tensor, table: torch.Tensor, block_size: int, mode: str
) -> DeviceSlots:
    """A decode step's slots from device tensors alone (CUDA graphs): request i has
    `seq_lens[i] - 1` tokens before its new one; padding rows (length 0) read and write
    nothing."""
    seq = seq_lens.long()
    if mode == "none":
        read_pos = write_pos = torch.zeros_like(seq)
    else:
        read_pos = ((seq - 2).clamp(min=0)) // block_size
        write_pos = ((seq - 1).clamp(min=0)) // block_size
    read = table.gather(1, read_pos[:, None])[:, 0]
    write = table.gather(1, write_pos[:, None])[:, 0]
    none = torch.full_like(read, -1)
    return DeviceSlots(
        read=torch.where(seq >= 2, read, none).int(),
        write=torch.where(seq >= 1, write, none).int(),
    )


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


def conv_windows(xbc: torch.Tensor, convs: torch.Tensor, slots: DeviceSlots) -> list[torch.Tensor]:
    """The `K - 1` convolution inputs before each checkpoint (carried rows from the state read,
    which the kernels may overwrite, so taken first)."""
    width = convs.shape[1]
    windows = []
    for start, done, _block, read in slots.conv_checkpoints:
        carried = convs[read] if read >= 0 else torch.zeros_like(convs[0])
        window = torch.cat([carried, xbc[start : start + done]])
        windows.append(window[done : done + width].clone())
    return windows


def _split(
    conv: torch.Tensor, shape: tuple[int, int, int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    heads, head_size, groups, state = shape
    x, B, C = conv.split([heads * head_size, groups * state, groups * state], dim=-1)
    rows = conv.shape[0]
    return (x.view(rows, heads, head_size), B.view(rows, groups, state),
            C.view(rows, groups, state))  # fmt: skip
