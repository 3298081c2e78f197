"""Smoke test of `benchmarks/batch_invariance.py --quick` on the CPU: both modes run, the JSON
has its fields, and the invariant mode's decode logits equal the request's alone. No timing
assertions: the numbers depend on the machine."""

from __future__ import annotations

import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "batch_invariance.py"


def test_quick_mode_writes_expected_json(bench, tmp_path):
    bench.main(["--quick", "--no-plot", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "batch_invariance.json").read_text())
    for key in ("machine", "command", "model", "device", "dtype", "params", "modes", "ratios"):
        assert key in data, key
    assert data["model"] == "tiny-llama" and data["device"] == "cpu"
    for mode in ("default", "invariant"):
        for phase in ("decode", "prefill"):
            assert data["modes"][mode][phase]["tokens_per_s"] > 0
    assert data["ratios"]["decode"] > 0 and data["ratios"]["prefill"] > 0
    assert data["invariance_alone_vs_batch"]["invariant"] is True
    assert data["matmul"] == []  # CUDA only
