"""The CUDA path's slot planning (`backends/mamba_device.py`) on host values: a decode step's
slots computed on the device equal the host plan's, and "all" mode's checkpoints land in the
scan's entries (the j-th chunk end after the request's offset)."""

import pytest
import torch

from unified_attn.backends.state_rows import StateRow
from unified_attn.backends.state_slots import device_slots, host_slots


@pytest.mark.parametrize("mode", ["none", "align", "all"])
def test_device_slots_of_a_decode_step_match_the_host_rule(mode):
    block_size = 4
    table = torch.arange(40, dtype=torch.int32).view(4, 10) + 1
    seq_lens = torch.tensor([1, 2, 5, 0], dtype=torch.int32)  # new, second token, boundary, pad
    slots = device_slots(seq_lens, table, block_size, mode)
    for i, seq in enumerate(seq_lens.tolist()):
        done = seq - 1
        if seq == 0:
            assert (slots.read[i], slots.write[i]) == (-1, -1)
            continue
        column = (lambda n: 0) if mode == "none" else (lambda n: (n - 1) // block_size)
        read = table[i, column(done)] if done else -1
        assert int(slots.read[i]) == int(read)
        assert int(slots.write[i]) == int(table[i, column(done + 1)])


def test_checkpoints_map_to_the_scan_entries_after_the_offset():
    rows = [
        StateRow(0, 20, 7, 9, offset=6, checkpoints=((2, 3), (10, 4), (18, 5))),  # 8, 16, 24
        StateRow(20, 21, None, 11, offset=0),
    ]
    slots = host_slots(rows, chunk_size=8, device=torch.device("cpu"))
    assert slots is not None
    assert slots.checkpoints.tolist() == [[3, 4, 5], [-1, -1, -1]]
    assert slots.read.tolist() == [7, -1] and slots.write.tolist() == [9, 11]
    assert slots.conv_checkpoints == ((0, 2, 3, 7), (0, 10, 4, 7), (0, 18, 5, 7))
    # a checkpoint off the chunk grid: the torch path runs
    off_grid = [StateRow(0, 20, 7, 9, offset=6, checkpoints=((6, 3),))]
    assert host_slots(off_grid, chunk_size=8, device=torch.device("cpu")) is None
