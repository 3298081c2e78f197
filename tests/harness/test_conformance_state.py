"""The conformance suite's state cells pass the shipped state backend and fail wrong ones."""

import pytest
import torch

from unified_attn.backends.linear_state import LinearStateBackend
from unified_attn.harness.conformance import run_conformance
from unified_attn.harness.conformance.state_cells import STATE_GRID

DEVICES = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.mark.parametrize("device", DEVICES)
def test_the_state_backend_passes_every_state_cell(device):
    report = run_conformance("linear-state", device)
    assert report["ok"] and report["passed"] == len(STATE_GRID), report["cells"]
    checks = report["cells"][-1]["checks"]
    assert checks["cache config pure"] == checks["in-place output"] == "pass"
    assert checks["rejects bad inputs"] == "pass"


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
    assert "max error" in failed[0]["detail"] and "step" in failed[0]["detail"]
    if backend is ForgetsItsState:  # a single prefill from zeros is right
        assert report["cells"][0]["status"] == "pass"


def test_attention_backends_report_state_cells_as_unsupported():
    report = run_conformance("reference", cells=STATE_GRID[:1])
    assert report["cells"][0]["status"] == "unsupported"
    assert "not linear_state" in report["cells"][0]["detail"]


class BrokenCacheConfig(LinearStateBackend):
    name = "broken-cache-config"

    def get_cache_config(self):
        raise ValueError("no config for you")


def test_a_cache_config_that_raises_fails_the_cell_not_the_run():
    from unified_attn.backends.reference import ReferenceAttentionBackend
    from unified_attn.harness.conformance import GRID

    class Broken(ReferenceAttentionBackend):
        name = "broken-attention-cache-config"

        def get_cache_config(self):
            raise ValueError("no config for you")

    report = run_conformance(Broken, cells=GRID[:1])
    assert report["cells"][0]["status"] == "fail"
    assert "no config for you" in report["cells"][0]["detail"]
    state = run_conformance(BrokenCacheConfig, cells=STATE_GRID[:1])
    assert state["cells"][0]["status"] == "fail"
