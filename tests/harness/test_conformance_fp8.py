"""The conformance suite's fp8 KV-cache cells (`FP8_GRID`): the reference and Triton backends
pass them (Triton in the interpreter on CPU), backends without an fp8 cache report them
unsupported with the reason, and backends that get the fp8 cache wrong fail them."""

from __future__ import annotations

import pytest
import torch

from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.harness.conformance import FP8_GRID, GRID, run_conformance
from unified_attn.harness.conformance.conformance_run import default_cells

TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("cell", FP8_GRID, ids=lambda c: c.name)
@pytest.mark.parametrize("backend, device", [("reference", "cpu"), ("triton", TRITON_DEVICE)])
def test_reference_and_triton_pass_every_fp8_cell(backend, device, cell):
    report = run_conformance(backend, device, cells=(cell,))
    (row,) = report["cells"]
    assert report["ok"] and row["status"] == "pass", row
    assert row["max_err"] <= row["tol"]
    assert {row["checks"][k] for k in ("fp8 page", "fp8 cache write")} == {"pass"}
    expected = "not compared" if "saturation" in cell.name else "pass"
    assert row["checks"]["fp8 vs unquantized"].startswith(expected)


def test_the_default_grid_includes_the_fp8_cells():
    cells = default_cells(ReferenceAttentionBackend, "cpu")
    assert all(cell in cells for cell in FP8_GRID)


def test_a_backend_without_an_fp8_cache_reports_the_cells_unsupported():
    report = run_conformance("legacy-reference", cells=GRID[:1] + FP8_GRID[:2])
    assert report["ok"] and report["unsupported"] == 2 and report["passed"] == 1
    for row in report["cells"][1:]:
        assert row["detail"] == "KV-cache dtype fp8 must equal the model dtype"


class ScaleOneBackend(ReferenceAttentionBackend):
    """Stores fp8 with scale 1.0 whatever was calibrated or given."""

    name = "fp8-scale-one"

    def _layer_scales(self, layer, given, k, v):
        scales = super()._layer_scales(layer, given, k, v)
        return None if scales is None else torch.ones_like(scales)


class RecalibratingBackend(ReferenceAttentionBackend):
    """Calibrates on every step: results would depend on the batch that runs."""

    name = "fp8-recalibrating"

    def prep_forward(self, common, block_tables, for_cudagraph_capture=False):
        if self.kv_scales is not None:
            self.kv_scales.fixed.clear()
        super().prep_forward(common, block_tables, for_cudagraph_capture)


@pytest.mark.parametrize(
    "backend, cell_name, check",
    [
        (ScaleOneBackend, "fp8 cache: mixed", "fp8 cache write"),
        (ScaleOneBackend, "fp8 cache: checkpoint scales", "fp8 cache write"),
        (RecalibratingBackend, "fp8 cache: saturation", "fp8 cache write"),
    ],
)
def test_backends_that_get_the_fp8_cache_wrong_fail(backend, cell_name, check):
    cell = next(c for c in FP8_GRID if c.name == cell_name)
    report = run_conformance(backend, cells=(cell,))
    (row,) = report["cells"]
    assert not report["ok"] and row["status"] == "fail"
    assert row["checks"][check].startswith("fail") and check in row["detail"]
