"""Conformance suite: any backend class through the unified contract, cell by cell, against the
reference backend driven through the same contract.

Every cell binds a strided cache view (block stride twice the page, non-zero offset) filled
with garbage that differs between the backend and the oracle, so reading a slot nobody wrote
shows up as a difference. Block tables are random and non-contiguous, the KV-cache group id is
not 0, and blocks a window or chunk no longer needs are replaced by the null block as the
managers do. A cell runs two steps: a prefill of the already-computed tokens, then the cell's
batch. Besides the outputs it checks the contract: `get_cache_config` is pure, the output is
written in place and returned, bad shapes and dtypes raise ValueError, and on CUDA `forward`
neither syncs with the host nor allocates (on CPU these two are "not measurable").

Backends of recurrent-state layers (`layer_kinds` with "linear_state") run the state cells of
`state` instead: several steps through `StateManager` state blocks, against the gated linear
recurrence computed token by token in float64.

Modules: `cells` (the grid), `steps` (a cell's inputs and block tables), `checks` (the
contract checks), `driver` (binding and stepping one backend), `oracle` (the comparison with
the reference backend), `run` (`run_cell`, `run_conformance`), `report` (`print_report`),
`prepare` (`prepare_cli`) and `command` (`unified-attn check`).
"""

from unified_attn.harness.conformance.cells import CUDA_CELLS, GRID, Cell
from unified_attn.harness.conformance.prepare import prepare_cli
from unified_attn.harness.conformance.report import print_report
from unified_attn.harness.conformance.run import run_cell, run_conformance

__all__ = [
    "CUDA_CELLS",
    "GRID",
    "Cell",
    "prepare_cli",
    "print_report",
    "run_cell",
    "run_conformance",
]
