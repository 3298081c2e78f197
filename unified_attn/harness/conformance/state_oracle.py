"""The state cells' oracle (`StateOracle`): each request's inputs by position and its state
after every token it kept, from the kind's one-token recurrence (`StateKind.token`).

A request's inputs are drawn once per position and replayed when it re-prefills after
preemption; a request resuming from another's checkpoint starts from that request's state
after the same number of tokens. Rows of rejected drafts are drawn fresh and never kept: the
next step continues from the state after the last row accepted.
"""

from __future__ import annotations

from typing import Any

import torch

from unified_attn.harness.conformance.state_cells import StateCell
from unified_attn.harness.conformance.state_kinds import Rows, State
from unified_attn.harness.conformance.state_steps import PlannedStep, Resume


class StateOracle:
    def __init__(self, cell: StateCell, weights: Any, gen: torch.Generator) -> None:
        self.cell, self.kind, self.weights, self.gen = cell, cell.state, weights, gen
        # request -> tokens -> the state after them
        self.history: dict[int, dict[int, State]] = {}
        # request -> position -> its input row (each input `[width]`)
        self.canonical: dict[int, dict[int, dict[str, torch.Tensor]]] = {}

    def start(self, resume: Resume) -> None:
        tokens = resume.tokens
        state = self.history[resume.source][tokens] if tokens else self.kind.zero_state(self.cell)
        self.history[resume.request] = {tokens: state}

    def inputs(self, step: PlannedStep) -> Rows:
        """The step's input rows `[T, width]` (host): per request, its rows at the positions
        it keeps (drawn the first time), then fresh rows for its rejected drafts."""
        for resume in step.starts:
            self.start(resume)
        rows: list[dict[str, torch.Tensor]] = []
        for r in step.rows:
            done, kept = step.done[r], step.kept[r]
            rows += self._kept_rows(r, done, kept) + self._draw(step.new[r] - kept)
        return {name: torch.stack([row[name] for row in rows]) for name in rows[0]}

    def _kept_rows(self, r: int, done: int, kept: int) -> list[dict[str, torch.Tensor]]:
        drawn = self.canonical.setdefault(r, {})
        missing = [p for p in range(done, done + kept) if p not in drawn]
        drawn.update(zip(missing, self._draw(len(missing)), strict=True))
        return [drawn[p] for p in range(done, done + kept)]

    def _draw(self, count: int) -> list[dict[str, torch.Tensor]]:
        if not count:
            return []
        rows = self.kind.random_rows(self.cell, count, self.gen)
        return [{name: t[i] for name, t in rows.items()} for i in range(count)]

    def run(self, step: PlannedStep, rows: Rows) -> tuple[torch.Tensor, dict[int, list[State]]]:
        """The step token by token: outputs `[T, H * D]` and, per request, the state after
        each of its rows; the states of rows kept go into the history."""
        outputs: list[torch.Tensor] = []
        after: dict[int, list[State]] = {}
        token = 0
        for r in step.rows:
            done = step.done[r]
            history = self.history.setdefault(r, {0: self.kind.zero_state(self.cell)})
            state, after[r] = history[done], []
            for n in range(1, step.new[r] + 1):
                row = {name: t[token] for name, t in rows.items()}
                out, state = self.kind.token(self.cell, state, row, self.weights)
                outputs.append(out)
                after[r].append(state)
                if n <= step.kept[r]:
                    history[done + n] = state
                token += 1
        return torch.stack(outputs), after
