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


def _speculation(common: CommonAttentionMetadata) -> tuple[list[int], list[int]]:
    """Per request: draft tokens verified this step, and the state-table column holding its
    state (zeros without speculative decoding)."""
    zeros = [0] * common.num_reqs
    drafts, columns = common.num_drafts_cpu, common.state_columns_cpu
    return (
        zeros if drafts is None else drafts.tolist()[: common.num_reqs],
        zeros if columns is None else columns.tolist()[: common.num_reqs],
    )


def _slot_row(
    table: list[int], start: int, end: int, done: int, drafts: int, column: int
) -> StateRow:
    """Mode "none": the state is read from column `column` (the previous step's last kept
    token). A step verifying drafts leaves the state after each of its tokens, token j's in
    column j, so the next step resumes from whichever was kept; other steps write column 0."""
    read = table[column] if done else None
    if not drafts:
        return StateRow(start, end, read, table[0], done)
    keep = tuple((j, table[j - 1]) for j in range(1, end - start))
    return StateRow(start, end, read, table[end - start - 1], done, keep)


def state_rows(
    common: CommonAttentionMetadata, block_table: torch.Tensor, block_size: int, mode: str
) -> list[StateRow]:
    """One row per request. "none": the state lives in table column 0 (or, with speculative
    decoding, the column `_slot_row` names). "align" and "all": the state after n tokens lives
    at position `(n - 1) // block_size`; "all" also checkpoints each boundary crossed."""
    qsl, _, computed = common.host_lists()
    table = block_table.cpu().tolist()
    drafts, columns = _speculation(common)
    rows = []
    for i in range(common.num_reqs):
        start, end, done = qsl[i], qsl[i + 1], computed[i]
        if mode == "none":
            rows.append(_slot_row(table[i], start, end, done, drafts[i], columns[i]))
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
