"""Smoke test of `benchmarks/speculative.py --quick` on the CPU: it runs and writes the JSON.
No timing assertions: the numbers depend on the machine."""

from __future__ import annotations

import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "speculative.py"


def test_quick_mode_writes_expected_json(bench, tmp_path):
    argv = ["--quick", "--device", "cpu", "--batch-sizes", "1,2", "--no-plot",
            "--out", str(tmp_path)]  # fmt: skip
    bench.main(argv)
    data = json.loads((tmp_path / "speculative.json").read_text())
    for key in ("machine", "command", "model", "backend", "params", "rows"):
        assert key in data, key
    assert [r["batch_size"] for r in data["rows"]] == [1, 2]
    for row in data["rows"]:
        assert row["identical_tokens"]
        assert row["speculative"]["drafted"] > 0 and row["plain"]["drafted"] == 0
        assert row["speedup"] > 0
