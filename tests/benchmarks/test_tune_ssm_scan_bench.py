"""Smoke tests of `benchmarks/tune_ssm_scan.py` on the CPU: the candidate tiles (each kernel's
fields swept over the defaults, rows within the chunk) and the refusal without CUDA."""

from __future__ import annotations

from pathlib import Path

from tests.benchmarks.smoke import assert_refuses_without_cuda
from unified_attn.backends.triton.ssm_ops import ScanTiles

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tune_ssm_scan.py"


def test_candidates_vary_one_kernel_over_the_defaults(bench):
    scan = bench.candidates(bench.SCAN_FIELDS, chunk=128)
    assert len(scan) == 48 and ScanTiles() in scan
    assert {t.state_p for t in scan} == {ScanTiles().state_p}  # the other kernel's defaults
    assert max(t.scan_m for t in bench.candidates(bench.SCAN_FIELDS, chunk=64)) == 64
    assert bench._name(ScanTiles(scan_m=32), ScanTiles()) == "scan_m=32"


def test_refuses_without_cuda(bench, capsys, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    assert_refuses_without_cuda(bench, None, capsys)
