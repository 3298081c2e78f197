"""A state cell's steps as the scheduler and `StateManager` would hand them to a backend
(`plan_steps`): who runs how many tokens after how many, each request's state table, the
speculation fields, and where each state must land (`StateWrite`), derived from the manager's
rules (`managers/state.py`), not from any backend's plan:

- "align" and "all": table position p holds the state after a step ending in block p, so a
  step ending at n tokens writes position `(n - 1) // block_size`; "all" also writes position
  `b / block_size - 1` with the state after b tokens for every boundary b inside the step.
  Positions before the one read are the null block (the manager freed them), so reading a
  stale position reads garbage. A state after a block boundary is a checkpoint a later request
  (or the same one, re-prefilled after preemption) can resume from (`Resume`).
- "none": column 0 holds the state; a step verifying drafts (`Verify`) leaves the state after
  its row j in column j, and the next step reads the column of the last row kept.

Block ids here are logical (1, 2, ...; 0 is the null block); the cell maps them to random
physical ids. A preempted request re-prefills into its own old blocks, which still hold its
stale states.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from unified_attn.harness.conformance.state_cells import StateCell


@attrs.frozen
class Resume:
    """At `step`, `request` (new, or preempted after its last step) starts with `tokens`
    computed: the checkpoint `source` left after that many tokens (0: from nothing)."""

    step: int
    request: int
    source: int
    tokens: int = 0


@attrs.frozen
class Verify:
    """At `step`, `request`'s tokens are its last sampled token and drafts; it keeps
    `accepted` drafts (the rows after those are rejected)."""

    step: int
    request: int
    accepted: int


@attrs.frozen
class StateWrite:
    """The state of `request` after `rows` of its rows in the step must be in `block`."""

    request: int
    block: int
    rows: int


@attrs.frozen
class PlannedStep:
    rows: tuple[int, ...]  # the requests in the step, in batch order
    done: tuple[int, ...]  # per request of the cell: tokens computed before the step
    new: tuple[int, ...]  # per request: rows in the step (0: not in it)
    kept: tuple[int, ...]  # per request: rows that stay computed (fewer when drafts are rejected)
    tables: tuple[tuple[int, ...], ...]  # per row of the step: its state table, logical ids
    writes: tuple[StateWrite, ...]
    # per row of the step: drafts verified and the table column read; None without speculation
    drafts: tuple[int, ...] | None
    columns: tuple[int, ...] | None
    starts: tuple[Resume, ...]  # requests (re)starting in this step


@attrs.define
class _Planner:
    cell: StateCell
    done: list[int]
    column: list[int]
    ids: list[list[int]]  # per request: logical block id at each table position
    next_id: int = 1
    # (request, tokens) -> (block, step): the checkpoints written so far
    checkpoints: dict[tuple[int, int], tuple[int, int]] = attrs.Factory(dict)

    def fresh(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def resume(self, resume: Resume, step: int) -> None:
        cell, r = self.cell, resume.request
        self.done[r], self.column[r] = resume.tokens, 0
        if not resume.tokens:
            return
        found = self.checkpoints.get((resume.source, resume.tokens))
        if found is None or found[1] >= step:
            raise ValueError(
                f"cell {cell.name!r}: request {r} resumes at step {step + 1} from request "
                f"{resume.source}'s checkpoint after {resume.tokens} tokens, which no earlier "
                "step left (a checkpoint is a state after a block boundary; in mode align only "
                "where a step ended)"
            )
        position = (resume.tokens - 1) // cell.block_size
        row = self.ids[r] + [0] * (position + 1 - len(self.ids[r]))
        row[position] = found[0]
        self.ids[r] = row

    def table(self, r: int, new: int) -> tuple[int, ...]:
        """Request r's table for a step of `new` rows (blocks allocated as needed)."""
        cell, done = self.cell, self.done[r]
        if cell.mode == "none":
            width, first = 1 + cell.num_speculative_blocks, 0
        else:
            width = (done + new - 1) // cell.block_size + 1
            first = (done - 1) // cell.block_size if done else 0
        row = self.ids[r] + [0] * (width - len(self.ids[r]))
        row[first:] = [block or self.fresh() for block in row[first:]]
        self.ids[r] = row
        return (0,) * first + tuple(row[first:])

    def writes(self, r: int, new: int, table: tuple[int, ...], drafts: int) -> list[StateWrite]:
        bs, done = self.cell.block_size, self.done[r]
        if self.cell.mode == "none":
            rows = range(1, new + 1) if drafts else [new]
            return [StateWrite(r, table[n - 1 if drafts else 0], n) for n in rows]
        ends = [*range((done // bs + 1) * bs, done + new, bs)] if self.cell.mode == "all" else []
        return [StateWrite(r, table[(end - 1) // bs], end - done) for end in [*ends, done + new]]

    def step(self, index: int, new: tuple[int, ...]) -> PlannedStep:
        cell = self.cell
        starts = tuple(r for r in cell.resumes if r.step == index)
        for resume in starts:
            self.resume(resume, index)
        accepted = {v.request: v.accepted for v in cell.verifies if v.step == index}
        rows = tuple(r for r, n in enumerate(new) if n)
        drafts = [new[r] - 1 if r in accepted else 0 for r in rows]
        columns = [self.column[r] for r in rows]
        tables = [self.table(r, new[r]) for r in rows]
        writes = [w for r, t, d in zip(rows, tables, drafts, strict=True)
                  for w in self.writes(r, new[r], t, d)]  # fmt: skip
        kept = tuple(accepted[r] + 1 if r in accepted else n for r, n in enumerate(new))
        speculating = any(drafts) or any(columns)
        step = PlannedStep(rows, tuple(self.done), new, kept, tuple(tables), tuple(writes),
                           tuple(drafts) if speculating else None,
                           tuple(columns) if speculating else None, starts)  # fmt: skip
        self.finish(step, index, accepted)
        return step

    def finish(self, step: PlannedStep, index: int, accepted: dict[int, int]) -> None:
        for write in step.writes:  # a block written again no longer holds its checkpoint
            self.checkpoints = {k: v for k, v in self.checkpoints.items() if v[0] != write.block}
        for write in step.writes:
            tokens = self.done[write.request] + write.rows
            if self.cell.mode != "none" and not tokens % self.cell.block_size:
                self.checkpoints[(write.request, tokens)] = (write.block, index)
        for r in step.rows:
            self.done[r] += step.kept[r]
            self.column[r] = accepted.get(r, 0)


def plan_steps(cell: StateCell) -> tuple[list[PlannedStep], int]:
    """The cell's steps and the number of logical blocks they use (ids 1..n)."""
    requests = len(cell.steps[0])
    planner = _Planner(cell, [0] * requests, [0] * requests, [[] for _ in range(requests)])
    steps = [planner.step(i, new) for i, new in enumerate(cell.steps)]
    return steps, planner.next_id - 1
