"""The migration harness passes correct ports and catches wrong native backends."""

import attrs
import pytest
import torch

from unified_attn.engine.outputs import RequestOutput
from unified_attn.harness.migration import (
    SMALL_WORKLOAD,
    compare_outputs,
    run_migration,
    source_lines,
)

WRONG = "tests.harness.wrong_backends:"


def test_legacy_reference_matches_native_reference_on_the_full_workload():
    report = run_migration("reference", "reference")
    assert report["ok"], report["failures"]
    assert report["max_abs_logit_diff"] <= 1e-4 and report["token_mismatches"] == 0
    coverage = report["coverage"]["legacy"]
    assert coverage["preemptions"] > 0 and coverage["prefix_hit_tokens"] > 0
    assert coverage["mixed_prefill_decode_steps"] > 0 and coverage["chunked_prefills"] > 0
    assert coverage["sliding_window_layers"] == 2 and coverage["chunked_local_layers"] == 1
    loc = report["lines_of_code"]
    assert len(loc["legacy"]["classes"]) == 4 and loc["native"]["total"] > 0
    assert report["host_time"]["legacy"]["prep_forward"] > 0


def test_legacy_triton_matches_native_triton_on_a_small_workload():
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter
    report = run_migration(
        "triton",
        "triton",
        model="tiny-llama",
        device=device,
        workload=SMALL_WORKLOAD,
        measure_host_time=False,
    )
    assert report["ok"], report["failures"]
    assert report["legacy"]["backend"] == "legacy-triton"
    assert report["coverage"]["native"]["preemptions"] > 0


@pytest.mark.parametrize("native", ["WrongScaleBackend", "IgnoresWindowBackend"])
def test_wrong_native_backends_fail_with_the_diff(native):
    report = run_migration(
        "reference", WRONG + native, workload=SMALL_WORKLOAD, measure_host_time=False
    )
    assert not report["ok"]
    assert report["max_abs_logit_diff"] > 1e-3
    assert report["failures"][0].startswith("token index")
    assert "max |logit diff|" in report["failures"][0]


@pytest.mark.parametrize(
    "model, workload", [("tiny-llama", None), ("mistral-like", SMALL_WORKLOAD)]
)
def test_migrate_forces_the_preemptions_it_judges(model, workload):
    """The cache is sized from the workload's own peak, so any model preempts."""
    report = run_migration("legacy-reference", "reference", model=model, workload=workload,
                           measure_host_time=False)  # fmt: skip
    assert report["ok"], report["failures"]
    assert all(cov["preemptions"] > 0 for cov in report["coverage"].values())
    assert report["notes"] == []


def test_a_workload_that_cannot_preempt_is_a_note_not_a_failure():
    one = attrs.evolve(SMALL_WORKLOAD, num_requests=1)
    report = run_migration("legacy-reference", "reference", model="tiny-llama", workload=one,
                           measure_host_time=False)  # fmt: skip
    assert report["ok"], report["failures"]
    assert "one request cannot mix prefill and decode steps" in report["notes"]
    assert any(note.startswith("the workload cannot preempt") for note in report["notes"])


@pytest.mark.parametrize("atol", [-1.0, float("nan"), float("inf")])
def test_a_tolerance_must_be_finite_and_not_negative(atol):
    with pytest.raises(ValueError, match="atol must be a finite number >= 0"):
        run_migration("legacy-reference", "reference", atol=atol)


def output(tokens, logits):
    return RequestOutput("r", [1], tokens, "length", logits=torch.tensor(logits))


def test_a_token_flip_at_a_near_tie_is_a_tie_and_stops_that_request():
    old = output([0, 1, 1], [[1.0, 1.00001], [0.0, 1.0], [0.0, 1.0]])
    new = output([1, 1, 0], [[1.0, 1.00002], [0.0, 1.0], [5.0, 1.0]])
    rows = compare_outputs([old], [new], atol=1e-4)
    assert [(r["ties"], r["token_mismatches"], r["ok"]) for r in rows] == [(1, 0, True)]
    far = output([1, 1, 1], [[0.0, 2.0], [0.0, 1.0], [0.0, 1.0]])
    rows = compare_outputs([old], [far], atol=1e-4)
    assert rows[0]["token_mismatches"] == 1 and not rows[0]["ok"]


def test_source_lines_skip_blanks_comments_and_docstrings():
    def sample(x):
        """Doc
        string."""
        # a comment

        return x  # trailing comments count as code

    assert source_lines(sample) == 2
