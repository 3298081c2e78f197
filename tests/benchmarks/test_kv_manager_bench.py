"""Smoke test of `benchmarks/kv_manager.py --quick`: it runs and writes the expected JSON.

No timing assertions: the numbers depend on the machine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kv_manager.py"


def test_quick_mode_writes_expected_json(bench, tmp_path):
    returned = bench.main(["--quick", "--no-plot", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "kv_manager.json").read_text())
    assert data["mode"] == "quick"
    assert data["verdicts"] == json.loads(json.dumps(returned["verdicts"]))

    for key in (
        "machine",
        "command",
        "params",
        "targets",
        "prefill",
        "decode",
        "churn",
        "block_pool",
        "verdicts",
    ):
        assert key in data, key
    for key in ("platform", "python_version", "cpu_count", "cpu_model"):
        assert key in data["machine"], key
    assert "--quick" in data["command"]

    configs = {"full", "hybrid_full_swa128"}
    assert set(data["prefill"]) == configs
    assert set(data["decode"]) == configs
    assert set(data["churn"]) == configs
    for r in data["prefill"].values():
        for key in ("allocate_slots_per_s", "hit_rate", "hashing_tokens_per_s"):
            assert key in r, key
        assert 0.0 < r["hit_rate"] < 1.0  # shared prefixes hit, suffixes miss
    for r in data["decode"].values():
        assert {"median", "p90"} <= set(r["step_us"])
        assert len(r["step_us_all"]) == r["steps"] * r["repeats"]
    for r in data["churn"].values():
        assert {"allocate_slots_per_s", "evictions", "blocks_popped"} <= set(r)
        # Distinct prompts on a small, full-of-cached-blocks pool: every pop evicts.
        assert r["evictions"] == r["blocks_popped"] > 0
    assert set(data["block_pool"]) == {"1000", "10000", "100000"}
    for r in data["block_pool"].values():
        assert "get_free_us_per_block" in r["unhashed"]
        assert "get_free_us_per_block" in r["hashed_evicting"]
        assert "touch_us_per_block" in r["touch_middle"]
    assert "hybrid_decode_step" in data["verdicts"]
    assert "block_pool_flat" in data["verdicts"]


def test_plot_is_skipped_without_matplotlib(bench, tmp_path, monkeypatch):
    import io

    from rich.console import Console

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    text = io.StringIO()
    png = tmp_path / "kv_manager.png"
    assert bench.plot({}, png, Console(file=text)) is False
    assert not png.exists()
    assert "matplotlib is not installed" in text.getvalue()


def test_lookup_mode_writes_every_config_and_case(bench, tmp_path):
    """`--lookup --quick`: one row per (config, prompt length, case) with its hit; a hybrid's
    plain prefix hits as much as full attention alone (the timings are not checked)."""
    bench.main(["--lookup", "--quick", "--no-plot", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "kv_lookup.json").read_text())
    rows = {(r["config"], r["prompt_len"], r["case"]): r for r in data["lookup"]["rows"]}
    configs = set(data["params"]["configs"])
    assert {"full", "full_swa128", "full_swa1024"} <= configs
    for (_config, length, case), row in rows.items():
        assert row["min_us"] <= row["median_us"] and row["min_us"] > 0
        if case == "miss":
            assert row["hit_tokens"] == 0
        if case == "prefix":
            assert row["hit_tokens"] == rows["full", length, "prefix"]["hit_tokens"] > 0
