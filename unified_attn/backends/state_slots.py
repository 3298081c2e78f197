"""The slots a state layer's kernels read and write in a step (`DeviceSlots`): planned on the
host from a step's `StateRow`s (`host_slots`), or for a CUDA-graph decode step on the device
from `seq_lens` and the block tables alone (`device_slots`); and the convolution inputs each
checkpoint keeps (`conv_windows`). Shared by the Mamba-2 and gated delta-net kernel paths."""

from __future__ import annotations

import attrs
import torch

from unified_attn.backends.state_rows import StateRow


@attrs.frozen
class DeviceSlots:
    """A group's slots for one step, all int32 on the device."""

    read: torch.Tensor  # [R] block holding the state before the step, -1: zeros
    write: torch.Tensor  # [R] block receiving the state after it, -1: none (padding)
    offsets: torch.Tensor | None = None  # [R] tokens before the step (varlen steps)
    # [R, M]: the scan's checkpoint entries ("all" mode), None without checkpoints
    checkpoints: torch.Tensor | None = None
    # positions between entries: entry j of request r is the state after absolute position
    # (offsets[r] // checkpoint_grid + 1 + j) * checkpoint_grid
    checkpoint_grid: int = 1
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
        checkpoint_grid=chunk_size,
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
