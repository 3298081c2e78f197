"""Smoke test of `benchmarks/eviction.py --quick`: it runs, writes the expected JSON, and
window-aware eviction never hits less than LRU on its workload.

No timing assertions: only hit rates and counts, which are deterministic (fixed seeds).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "eviction.py"
CONFIGS = {"hybrid_full_swa128", "hybrid_full_swa1024", "full"}


@pytest.fixture(scope="module")
def quick(bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("eviction")
    returned = bench.main(["--quick", "--no-plot", "--out", str(out)])
    return returned, json.loads((out / "eviction.json").read_text())


def test_quick_mode_writes_expected_json(quick):
    returned, data = quick
    assert data["mode"] == "quick" and "--quick" in data["command"]
    assert data["configs"] == json.loads(json.dumps(returned["configs"]))
    for key in ("machine", "params", "workload", "configs", "elapsed_s"):
        assert key in data, key
    assert set(data["configs"]) == CONFIGS
    seeds = data["params"]["seeds"]
    for name, rows in data["configs"].items():
        assert list(rows) == [str(n) for n in data["params"]["pool_sizes"][name]]
        for row in rows.values():
            for policy in ("lru", "window_aware"):
                assert 0.0 < row[f"{policy}_admission_hit_rate"] < 1.0
                assert len(row["runs"][policy]) == len(seeds)
                assert all(run["evictions"] > 0 for run in row["runs"][policy])


def test_window_aware_never_hits_less_than_lru(quick):
    _, data = quick
    for name, rows in data["configs"].items():
        for pool, row in rows.items():
            assert row["hit_rate_gain_min"] >= 0.0, (name, pool, row["hit_rate_gain_min"])
            wa = row["runs"]["window_aware"]
            dead = sum(run["dead_evictions"] for run in wa)
            if name == "full":  # nothing dies without evict_blocks: the very same runs
                drop = ("elapsed_s",)
                same = [{k: v for k, v in r.items() if k not in drop} for r in row["runs"]["lru"]]
                assert dead == 0 and same == [{k: r[k] for k in same[0]} for r in wa]
            else:
                assert dead > 0, (name, pool)


def test_plot_is_skipped_without_matplotlib(bench, tmp_path, monkeypatch):
    import io

    from rich.console import Console

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    text = io.StringIO()
    png = tmp_path / "eviction.png"
    assert bench.plot({}, png, Console(file=text)) is False
    assert not png.exists()
    assert "matplotlib is not installed" in text.getvalue()
