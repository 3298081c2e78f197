"""Smoke test of `benchmarks/tensor_parallel.py --quick` on the CPU (gloo): it runs two ranks
against one device and writes the JSON; no timing is checked."""

from __future__ import annotations

import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tensor_parallel.py"


def test_quick_mode_compares_two_ranks_with_one_device(bench, tmp_path):
    bench.main(["--quick", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "tensor_parallel.json").read_text())
    assert data["tp1"]["rank_num_blocks"] == [data["tp1"]["num_blocks"]]
    assert len(data["tp2"]["rank_num_blocks"]) == 2
    assert data["capacity_ratio_per_gpu"] == 2.0  # a rank holds half the KV heads
    assert data["prompt_logits"]["argmax_agreement"] == 1.0  # float32 on the CPU
    assert data["prompt_logits"]["max_abs_diff"] < 1e-4
    fp = data["prompt_logits_vs_float32"]
    assert fp["tp1"]["max_abs_diff"] == 0.0  # the run is float32: its own yardstick
    assert fp["tp2"]["max_abs_diff"] < 1e-4
    assert [d["batch"] for d in data["tp2"]["decode"]] == [4, 4]
    assert all(v > 0 for v in data["decode_speedup"].values())
