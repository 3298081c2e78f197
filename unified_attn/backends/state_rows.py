"""Where a state layer reads and writes each request's state in a step, from its block table
and the manager's mode (`managers/state.py`): the host-side plan both state backends share."""

from __future__ import annotations

from typing import NamedTuple

import torch

from unified_attn.backend import CommonAttentionMetadata


class StateRow(NamedTuple):
    """One request of a step in a state group (host ints)."""

    start: int  # first token row
    end: int  # one past its last token row
    read: int | None  # block holding the state to start from; None: start from zeros
    write: int  # block that receives the state after the last token
    offset: int = 0  # tokens the request had before this step
    # ("all" mode) (rows, block): the state after the first `rows` rows goes to `block`, one
    # per block boundary the step crosses before its last token
    checkpoints: tuple[tuple[int, int], ...] = ()


def state_rows(
    common: CommonAttentionMetadata, block_table: torch.Tensor, block_size: int, mode: str
) -> list[StateRow]:
    """One row per request. "none": the state lives in table column 0. "align" and "all": the
    state after n tokens lives at position `(n - 1) // block_size`; "all" also checkpoints
    each boundary crossed."""
    qsl, _, computed = common.host_lists()
    table = block_table.cpu().tolist()
    rows = []
    for i in range(common.num_reqs):
        start, end, done = qsl[i], qsl[i + 1], computed[i]
        if mode == "none":
            rows.append(StateRow(start, end, table[i][0] if done else None, table[i][0], done))
            continue
        last = done + end - start
        read = table[i][(done - 1) // block_size] if done else None
        checkpoints: tuple[tuple[int, int], ...] = ()
        if mode == "all":
            checkpoints = tuple(
                (boundary - done, table[i][boundary // block_size - 1])
                for boundary in range((done // block_size + 1) * block_size, last, block_size)
            )
        rows.append(StateRow(start, end, read, table[i][(last - 1) // block_size], done,
                             checkpoints))  # fmt: skip
    return rows
