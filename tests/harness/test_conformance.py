"""The conformance suite passes the shipped backends and fails the wrong fixtures."""

import pytest
import torch

from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.harness.conformance import GRID, run_conformance
from unified_attn.harness.conformance.invariance import INVARIANCE_GRID
from unified_attn.managers import SlidingWindowManager

WRONG = "tests.harness.wrong_backends:"
# Triton runs in its interpreter on CPU (tests/conftest.py), on the GPU where there is one.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CELLS = {cell.name: cell for cell in GRID}
SMALL = tuple(CELLS[n] for n in ("mixed", "sliding window 8", "chunked local 16", "learned sinks"))


@pytest.mark.parametrize(
    ("backend", "cells", "device"),
    [
        ("reference", GRID, "cpu"),
        ("legacy-reference", GRID, "cpu"),
        ("triton", GRID, TRITON_DEVICE),
        ("legacy-triton", SMALL, TRITON_DEVICE),
        ("unified_attn.legacy_adapter.ports.legacy_reference:LegacyReferenceBackend", SMALL, "cpu"),
    ],
)
def test_shipped_backends_pass(backend, cells, device):
    report = run_conformance(backend, device, cells=cells)
    assert report["ok"], [(r["cell"], r["detail"]) for r in report["cells"]]
    # legacy KV-cache specs have no StreamingLLM policy: the adapters decline that cell
    declined = {"sink tokens 4 + window 8"} & set(CELLS) if "legacy" in backend.lower() else set()
    assert {r["cell"] for r in report["cells"] if r["status"] == "unsupported"} == (
        declined & {c.name for c in cells}
    )
    assert report["passed"] == len(cells) - len(declined & {c.name for c in cells})
    checks = report["cells"][0]["checks"]
    assert checks["in-place output"] == checks["rejects bad inputs"] == "pass"
    assert checks["cache config pure"] == "pass"
    assert checks["host sync"] == "pass" if device == "cuda" else "not measurable on CPU"


def test_wrong_scale_fails_every_cell_with_where_the_error_is():
    report = run_conformance(WRONG + "WrongScaleBackend", cells=SMALL)
    assert not report["ok"] and report["failed"] == len(SMALL)
    assert "max error" in report["cells"][0]["detail"]
    assert "request" in report["cells"][0]["detail"]


def test_ignoring_the_window_fails_only_the_window_cell():
    report = run_conformance(WRONG + "IgnoresWindowBackend", cells=SMALL)
    failed = [r["cell"] for r in report["cells"] if r["status"] == "fail"]
    assert failed == ["sliding window 8"] and not report["ok"]


class NoSinks(ReferenceAttentionBackend):
    name = "no-sinks"

    @classmethod
    def validate_configuration(cls, cfg):
        return ["sinks are not supported"] if cfg.has_sinks else []


class NoPureCacheConfig(ReferenceAttentionBackend):
    name = "impure"
    calls = 0

    def get_cache_config(self):
        type(self).calls += 1  # every other call claims a sliding window
        manager, config, spec = super().get_cache_config()
        if self.calls % 2:
            return SlidingWindowManager, SlidingWindowManager.Config(4096), spec
        return manager, config, spec


class ReturnsACopy(ReferenceAttentionBackend):
    name = "copy"

    def forward(self, layer, output, query, key, value, **kwargs):
        return super().forward(layer, output, query, key, value, **kwargs).clone()


def test_unsupported_cells_are_reported_not_passed():
    report = run_conformance(NoSinks, cells=SMALL)
    sinks = next(r for r in report["cells"] if r["cell"] == "learned sinks")
    assert sinks["status"] == "unsupported" and "sinks are not supported" in sinks["detail"]
    assert report["ok"] and report["unsupported"] == 1 and report["passed"] == len(SMALL) - 1


def test_a_backend_that_supports_nothing_does_not_pass():
    report = run_conformance(NoSinks, cells=(CELLS["learned sinks"],))
    assert not report["ok"] and report["unsupported"] == 1


@pytest.mark.parametrize(
    ("backend", "check"), [(NoPureCacheConfig, "cache config pure"), (ReturnsACopy, "in-place")]
)
def test_contract_violations_fail(backend, check):
    report = run_conformance(backend, cells=(CELLS["decode"],))
    assert not report["ok"]
    assert check in report["cells"][0]["detail"]


# ---- batch invariance ---------------------------------------------------------------------------


def test_reference_backend_passes_every_invariance_cell():
    report = run_conformance("reference", cells=INVARIANCE_GRID)
    assert report["passed"] == len(INVARIANCE_GRID), [
        (r["cell"], r["detail"]) for r in report["cells"]
    ]
    assert all(r["max_err"] == 0.0 for r in report["cells"])


def test_a_backend_that_does_not_claim_invariance_is_unsupported():
    report = run_conformance("legacy-reference", cells=INVARIANCE_GRID[:1])
    assert report["cells"][0]["status"] == "unsupported"
    assert "batch-invariant" in report["cells"][0]["detail"]


class BatchedDecodeClaimsInvariance(ReferenceAttentionBackend):
    """Claims the mode but attends decodes together whatever it is told (as the legacy port)."""

    def __init__(self, **kwargs):
        super().__init__(**{**kwargs, "batch_invariant": False})


def test_a_false_claim_fails_with_the_schedules_and_positions_that_differ():
    report = run_conformance(BatchedDecodeClaimsInvariance, cells=INVARIANCE_GRID[:2])
    for row in report["cells"]:
        assert row["status"] == "fail"
        assert "decode among 7: positions [45]" in row["detail"]
        assert row["max_err"] > 0


def test_triton_invariance_cells_need_a_gpu_in_the_interpreter():
    cells = INVARIANCE_GRID if TRITON_DEVICE == "cuda" else INVARIANCE_GRID[:1]
    report = run_conformance("triton", TRITON_DEVICE, cells=cells)
    if TRITON_DEVICE == "cuda":
        assert report["passed"] == len(cells), [(r["cell"], r["detail"]) for r in report["cells"]]
    else:
        assert report["cells"][0]["status"] == "unsupported"
        assert "numpy" in report["cells"][0]["detail"]
