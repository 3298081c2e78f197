"""The conformance suite's state cells (one grid of scenarios per state kind) pass the shipped
state backends (linear attention, Mamba-2, gated delta-net) and fail wrong ones, naming the
cell and where the error is."""

import re

import pytest
import torch

from tests.harness.buggy_state_backends import (
    DropsConvCarry,
    LateCheckpoints,
    NoDraftRollback,
    SkipsReadOnBoundary,
    planted,
)
from unified_attn.backends.gated_delta_state import GatedDeltaStateBackend
from unified_attn.backends.linear_state import LinearStateBackend
from unified_attn.backends.mamba_state import Mamba2StateBackend
from unified_attn.harness.conformance import run_conformance
from unified_attn.harness.conformance.state_cells import (
    SCENARIOS,
    STATE_GRID,
    StateCell,
    state_grid,
)
from unified_attn.harness.conformance.state_steps import Resume

DEVICES = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
WHERE = re.compile(r"max error \S+ > \S+ \(step \d+/\d+, request \d+, ")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["linear-state", "mamba2", "gated_delta"])
def test_the_state_backends_pass_every_state_cell(backend, device):
    report = run_conformance(backend, device)
    assert report["ok"] and report["passed"] == len(SCENARIOS), report["cells"]
    for row in report["cells"]:
        checks = row["checks"]
        assert checks["cache config pure"] == checks["in-place output"] == "pass"
        assert checks["rejects bad inputs"] == "pass"


def scenario(cell_name: str) -> str:
    return cell_name.split(": ", 1)[1]


# bug, the scenarios it must fail, one it must pass
PLANTED = {
    LateCheckpoints: (["mode all: checkpoints inside steps", "mode all: prefix hits inside steps",
                       "mode all: block size = scan chunk"], "prefill"),
    DropsConvCarry: (["prefill, decode", "chunked prefill across scan chunks, mixed",
                      "mode align: prefix hit", "preemption: re-prefill"], "prefill"),
    SkipsReadOnBoundary: (["mode align: prefix hit", "mode all: prefix hits inside steps"],
                          "prefill"),
    NoDraftRollback: (["mode none: drafts rejected, preemption"], "prefill, decode"),
}  # fmt: skip


@pytest.mark.parametrize("base", [Mamba2StateBackend, GatedDeltaStateBackend])
@pytest.mark.parametrize(
    ("bug", "broken", "intact"), [pytest.param(b, *p, id=b.__name__) for b, p in PLANTED.items()]
)
def test_a_planted_bug_fails_the_cells_it_breaks(base, bug, broken, intact):
    kind = base.layer_kinds[0]
    cells = tuple(c for c in state_grid(kind) if scenario(c.name) in [*broken, intact])
    report = run_conformance(planted(bug, base), cells=cells)
    rows = {scenario(r["cell"]): r for r in report["cells"]}
    assert not report["ok"] and rows[intact]["status"] == "pass", rows[intact]
    for name in broken:
        assert rows[name]["status"] == "fail" and WHERE.search(rows[name]["detail"]), rows[name]


def test_rejected_drafts_left_in_the_linear_state_fail_the_drafts_cell():
    cells = tuple(c for c in STATE_GRID if "drafts" in c.name)
    (row,) = run_conformance(planted(NoDraftRollback, LinearStateBackend), cells=cells)["cells"]
    assert row["status"] == "fail" and "(a rejected draft's)" in row["detail"]


class ForgetsItsState(LinearStateBackend):
    """Starts every step from zeros: right for a prefill, wrong for anything after it."""

    name = "forgets-its-state"

    def prep_forward(self, common, block_tables, for_cudagraph_capture=False):
        super().prep_forward(common, block_tables, for_cudagraph_capture)
        plan = self.current_plan()
        rows = {g: [r._replace(read=None) for r in rs] for g, rs in plan.requests.items()}
        self.plan = type(plan)(rows)


class WrongDecay(LinearStateBackend):
    """Applies the gate twice."""

    name = "wrong-decay"

    def forward(self, layer, output, query, key, value, **kwargs):
        return super().forward(layer, output, query, key, value, log_gate=2 * kwargs["log_gate"])


@pytest.mark.parametrize("backend", [ForgetsItsState, WrongDecay])
def test_wrong_state_backends_fail_with_where_the_error_is(backend):
    report = run_conformance(backend)
    failed = [r for r in report["cells"] if r["status"] == "fail"]
    assert not report["ok"] and failed
    assert WHERE.search(failed[0]["detail"])
    if backend is ForgetsItsState:  # a single prefill from zeros is right
        assert report["cells"][0]["status"] == "pass"


@pytest.mark.parametrize("kind", ["linear_state", "mamba2"])
def test_attention_backends_report_state_cells_as_unsupported(kind):
    report = run_conformance("reference", cells=state_grid(kind)[:1])
    assert report["cells"][0]["status"] == "unsupported"
    assert f"not {kind}" in report["cells"][0]["detail"]


def test_impossible_schedules_fail_at_construction():
    # request 0's first step ends at 13: mode align keeps no state after 12, mode all does
    hit = (Resume(step=1, request=1, source=0, tokens=12),)
    with pytest.raises(ValueError, match="checkpoint after 12 tokens, which no earlier step"):
        StateCell("hit", steps=((13, 0), (1, 5)), resumes=hit)
    StateCell("hit", steps=((13, 0), (1, 5)), resumes=hit, mode="all")
    with pytest.raises(ValueError, match="names a request that step 1 does not schedule"):
        StateCell("hit", steps=((13, 0),), resumes=(Resume(step=0, request=1, source=0),))
    with pytest.raises(ValueError, match="no state cells for layer kind 'attention'"):
        state_grid("attention")


def test_the_plan_puts_states_where_the_manager_keeps_them():
    # mode all, request 0's second step (13 -> 24): the states after 16, 20 and 24 tokens go
    # to table positions 3, 4 and 5; positions before the one read (3) are the null block
    (all_mode,) = [c for c in state_grid("mamba2") if c.name.endswith("prefix hits inside steps")]
    step = all_mode.plan()[0][1]
    table = step.tables[0]
    assert table[:3] == (0, 0, 0)
    assert [(w.rows, table.index(w.block)) for w in step.writes] == [(3, 3), (7, 4), (11, 5)]
    # mode none, request 0 verifies 3 drafts: the state after row j in column j; the next step
    # reads column 1 (one draft kept)
    (drafts,) = [c for c in state_grid("mamba2") if "drafts" in c.name]
    steps = drafts.plan()[0]
    table = steps[1].tables[0]
    writes = [w for w in steps[1].writes if w.request == 0]
    assert [(w.rows, table.index(w.block)) for w in writes] == [(1, 0), (2, 1), (3, 2), (4, 3)]
    assert steps[1].drafts == (3, 0, 0) and steps[2].columns == (1, 0)
