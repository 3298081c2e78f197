"""The conformance suite's encoder, encoder-only and cross-attention cells: the reference passes
them, Triton passes each type it declares and reports the others unsupported with its reasons,
and wrong backends fail with a diff naming the cell."""

import json

import pytest
import torch

from tests.harness import wrong_backends
from unified_attn.backend import AttentionType
from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.backends.triton import TritonAttentionBackend
from unified_attn.cli import main
from unified_attn.harness.conformance import (
    CROSS_GRID,
    CUDA_CELLS,
    ENCODER_GRID,
    GRID,
    run_conformance,
)
from unified_attn.managers import CrossAttentionManager, FullAttentionManager
from unified_attn.tensor_specs import PagedKVSpec

TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEW = ENCODER_GRID + CROSS_GRID
MIXED = next(cell for cell in GRID if cell.name == "mixed")
ENCODER_NAMES = [cell.name for cell in ENCODER_GRID]
CROSS_NAMES = [cell.name for cell in CROSS_GRID]


def failed(report):
    return [r["cell"] for r in report["cells"] if r["status"] == "fail"]


def test_the_reference_passes_every_new_cell():
    report = run_conformance("reference", cells=NEW)
    assert report["ok"] and report["passed"] == len(NEW), report["cells"]
    assert {r["type"] for r in report["cells"]} == {"encoder", "encoder_only", "encoder_decoder"}
    for row in report["cells"]:
        for check in ("cache config pure", "in-place output", "rejects bad inputs"):
            assert row["checks"][check] == "pass", (row["cell"], check)


def test_the_reference_passes_the_half_precision_cells_of_every_type():
    cells = tuple(c for c in CUDA_CELLS if c.attn_type != AttentionType.DECODER)
    assert {c.attn_type for c in cells} == set(AttentionType) - {AttentionType.DECODER}
    report = run_conformance("reference", cells=cells)
    assert report["ok"] and report["passed"] == len(cells), report["cells"]


@pytest.mark.parametrize("cell", NEW, ids=lambda cell: cell.name)
def test_triton_passes_the_types_it_declares_and_reports_the_others(cell):
    row = run_conformance("triton", TRITON_DEVICE, cells=(cell,))["cells"][0]
    reasons = TritonAttentionBackend.validate_configuration(cell.selector_config(TRITON_DEVICE))
    if reasons:
        assert row["status"] == "unsupported", row
        assert all(reason in row["detail"] for reason in reasons)
    else:
        assert row["status"] == "pass", row["detail"]


@pytest.mark.parametrize(
    ("backend", "expected"),
    [
        ("CausalEncoderBackend", ENCODER_NAMES),
        ("CrossIgnoresSlotMappingBackend", CROSS_NAMES),
        ("CrossReadsFirstBlockBackend", CROSS_NAMES),
        ("CrossAttendsStepKeysBackend", CROSS_NAMES),
    ],
)
def test_wrong_backends_fail_the_cells_of_their_type_with_a_diff(backend, expected):
    report = run_conformance(getattr(wrong_backends, backend), cells=(MIXED, *NEW))
    assert not report["ok"] and failed(report) == expected
    for row in report["cells"]:
        if row["status"] == "fail":
            assert row["detail"].startswith("max error") and "request" in row["detail"]


def test_reading_encoder_keys_back_from_the_cache_is_what_a_later_step_checks():
    report = run_conformance(wrong_backends.CrossAttendsStepKeysBackend, cells=CROSS_GRID[:1])
    assert "(step 2/2," in report["cells"][0]["detail"]  # step 1 (every encoder written) is right


class EncoderWithACache(ReferenceAttentionBackend):
    name = "encoder-with-a-cache"

    def get_cache_config(self):
        spec = PagedKVSpec(self.num_kv_heads, self.head_size, self.dtype)
        return FullAttentionManager, FullAttentionManager.Config(), spec


class CrossOfTheWrongSize(ReferenceAttentionBackend):
    name = "cross-of-the-wrong-size"

    def get_cache_config(self):
        manager, _, spec = super().get_cache_config()
        return manager, CrossAttentionManager.Config(4096), spec


@pytest.mark.parametrize(
    ("backend", "cell", "expected"),
    [
        (EncoderWithACache, ENCODER_GRID[0], "expects None (the layer keeps no KV cache)"),
        (CrossOfTheWrongSize, CROSS_GRID[0], "expects (CrossAttentionManager"),
    ],
)
def test_the_wrong_cache_config_for_the_type_fails(backend, cell, expected):
    row = run_conformance(backend, cells=(cell,))["cells"][0]
    assert row["status"] == "fail" and expected in row["detail"]
    assert row["checks"]["cache config pure"].startswith("fail")


class NoCrossAttention(ReferenceAttentionBackend):
    name = "no-cross-attention"

    @classmethod
    def validate_configuration(cls, cfg):
        cross = cfg.attn_type == AttentionType.ENCODER_DECODER
        return ["cross-attention is not supported"] if cross else []


def test_a_type_the_backend_does_not_declare_is_unsupported_with_its_reason():
    report = run_conformance(NoCrossAttention, cells=NEW)
    statuses = {r["cell"]: (r["status"], r["detail"]) for r in report["cells"]}
    assert report["ok"] and report["unsupported"] == len(CROSS_GRID)
    assert all(
        statuses[n] == ("unsupported", "cross-attention is not supported") for n in CROSS_NAMES
    )
    legacy = run_conformance("legacy-reference", cells=NEW)
    assert legacy["unsupported"] == len(NEW) and not legacy["ok"]  # nothing run: no pass
    assert "attention type encoder_only is not supported" in legacy["cells"][0]["detail"]


def test_the_check_command_shows_every_type(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["check", "tests.harness.wrong_backends:CausalEncoderBackend"]) == 1
    out = capsys.readouterr().out
    for title in (
        "decoder self-attention", "encoder-only self-attention", "cross-attention",
        "batch invariance",
    ):  # fmt: skip
        assert title in out
    assert all(cell.name in out for cell in NEW) and "FAIL" in out
    assert main(["check", "reference", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["cells"]
    types = {t.value for t in AttentionType} | {"batch_invariance", "manager"}
    assert {r["type"] for r in rows} == types
