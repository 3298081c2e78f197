"""State backends with one planted bug each, built over any of the shipped state backends
(`planted(bug, base)`): the conformance suite's state cells must report the cells the bug
breaks as failed."""

from __future__ import annotations

import attrs

from unified_attn.backends.mamba_state import Mamba2StateBackend
from unified_attn.backends.state_backend import StateBackend
from unified_attn.backends.state_rows import StateRow


class LateCheckpoints:
    """Saves each checkpoint (mode "all") at the end of the scan chunk after its block
    boundary, one chunk late; checkpoints that land on the same row keep the first only."""

    def plan_rows(self, common, block_tables):
        rows = super().plan_rows(common, block_tables)
        return {gid: [self.late(row) for row in group] for gid, group in rows.items()}

    def late(self, row: StateRow) -> StateRow:
        saved: dict[int, int] = {}
        for done, block in row.checkpoints:
            end = ((row.offset + done) // self.chunk_size + 1) * self.chunk_size - row.offset
            saved.setdefault(min(end, row.end - row.start), block)
        return row._replace(checkpoints=tuple(saved.items()))


class DropsConvCarry:
    """Convolves every step's first rows with zeros instead of the carried inputs."""

    def convolve(self, convs, inputs, row, weight, bias):
        return super().convolve(convs, inputs, row._replace(read=None), weight, bias)


class SkipsReadOnBoundary:
    """Starts from zeros when a step starts on a block boundary: every prefix hit."""

    def plan_rows(self, common, block_tables):
        rows = super().plan_rows(common, block_tables)
        return {
            gid: [r._replace(read=None) if not r.offset % common.block_sizes[gid] else r
                  for r in group]
            for gid, group in rows.items()
        }  # fmt: skip


class NoDraftRollback:
    """Ignores the speculation fields: a verify step leaves only its last state, rejected drafts
    included, and the next step reads it."""

    def prep_forward(self, common, block_tables, for_cudagraph_capture=False):
        common = attrs.evolve(common, num_drafts_cpu=None, state_columns_cpu=None)
        super().prep_forward(common, block_tables, for_cudagraph_capture)


BUGS = (LateCheckpoints, DropsConvCarry, SkipsReadOnBoundary, NoDraftRollback)


def planted(bug: type, base: type[StateBackend]) -> type[StateBackend]:
    """`base` with `bug` mixed in, under a name of its own."""
    return type(bug.__name__, (bug, base), {"name": f"{base.name}-{bug.__name__}"})


# for `unified-attn check tests.harness.buggy_state_backends:Mamba2NoDraftRollback`
Mamba2NoDraftRollback = planted(NoDraftRollback, Mamba2StateBackend)
