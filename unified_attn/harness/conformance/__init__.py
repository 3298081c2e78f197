"""Conformance suite: any backend class through the unified contract, cell by cell, against an
oracle, for every attention type (`AttentionType`) and recurrent-state layers.

Decoder cells run against the reference backend driven through the same contract. Every one
binds a strided cache view (block stride twice the page, non-zero offset) filled with garbage
that differs between the backend and the oracle, so reading a slot nobody wrote shows up as a
difference. Block tables are random and non-contiguous, the KV-cache group id is not 0, and
blocks a window or chunk no longer needs are replaced by the null block as the managers do. A
cell runs two steps: a prefill of the already-computed tokens, then the cell's batch.

Encoder and encoder-only cells (`ENCODER_GRID`) are one packed pass over whole inputs of mixed
lengths with no cache (`get_cache_config()` must be None, `prep_forward(common, {})`);
cross-attention cells (`CROSS_GRID`) write each request's encoder keys into a cross cache bound
over garbage in the step it is admitted and read them back in later steps (E = 0: an empty key).
Their oracle is `scaled_dot_product_attention` per request in float64, independent of every
backend (`sdpa`). A cell of a type the backend does not declare is reported "unsupported" with
the backend's reasons.

fp8 cells (`FP8_GRID`, decoder cells with `kv_cache_dtype="fp8"`) compare the backend with
attention over its own cache dequantized, check every written slot bit for bit against the
quantized key and value, and bound the difference from an unquantized cache (`fp8`).

Besides the outputs every cell checks the contract: `get_cache_config` is pure and of the cell's
kind, the output is written in place and returned, bad shapes and dtypes raise ValueError, and on
CUDA `forward` neither syncs with the host nor allocates (on CPU these two are "not
measurable").

Batch-invariance cells (`INVARIANCE_GRID`, module `invariance`) build the backend with
`batch_invariant=True` and run one target request alone, in chunks, and among companions at
other places in the batch, each on a fresh cache with its own block table: its output rows must
be bitwise the same. A backend that does not claim `supports_batch_invariance()` (or cannot on
the cell's device) is "unsupported" there.

Backends of multi-head latent attention (`layer_kinds` with "mla") run the MLA cells of `mla`:
a latent cache over garbage, queries and the layer's up-projection through the MLA contract,
against keys and values up-projected explicitly and attended by SDPA in float64.

Backends of recurrent-state layers (`layer_kinds` with "linear_state", "mamba2" or
"gated_delta") run the state cells instead: one grid of scenarios per state kind (prefill,
chunked prefill across the scan's chunks, decode, prefix hits on checkpoints in modes align and
all, drafts rejected in mode none, preemption and re-prefill), several steps through
`StateManager` state blocks over garbage, against the kind's recurrence computed token by token
(gated linear attention; Mamba-2's convolution and one-token SSD update; the gated delta-net's
convolution and one-token delta rule), outputs and every state part each step must leave.

Modules: `cells` (the grids), `steps` (a cell's inputs and block tables), `cross` (a cross cell's
steps), `checks` (the contract checks), `driver` (binding and stepping one backend), `oracle`
(the comparison with the reference backend), `sdpa` (the SDPA oracle of encoder and cross
cells), `fp8` (the fp8 cells' oracle and checks), `invariance` (the batch-invariance cells),
`mla` (the MLA cells), `state_cells` (the state scenarios, `state_grid`), `state_kinds` (each
state kind's inputs and one-token oracle), `state_steps` (where the manager keeps each state),
`state_oracle` and `state_run` (`run_state_cell`), `run` (`run_cell`, `run_conformance`) and
`report` (`print_report`);
the `unified-attn check` command is `unified_attn/cli/check.py`.
"""

from unified_attn.harness.conformance.cells import (
    CROSS_GRID,
    CUDA_CELLS,
    ENCODER_GRID,
    FP8_GRID,
    GRID,
    Cell,
    CrossCell,
)
from unified_attn.harness.conformance.conformance_report import print_report
from unified_attn.harness.conformance.conformance_run import run_cell, run_conformance

__all__ = [
    "CROSS_GRID",
    "CUDA_CELLS",
    "ENCODER_GRID",
    "FP8_GRID",
    "GRID",
    "Cell",
    "CrossCell",
    "print_report",
    "run_cell",
    "run_conformance",
]
