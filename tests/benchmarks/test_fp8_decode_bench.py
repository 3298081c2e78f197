"""Smoke tests of `benchmarks/fp8_decode.py`: `--help`, the clear exit (code 2) of a full run
without CUDA, and the `--quick` CPU run (Triton's interpreter, tiny float16 shapes) writing its
JSON with both cache dtypes, their ratio and the oracle check. No timing assertions: the
numbers depend on the machine (the ratio means something only on a GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fp8_decode.py"


def test_help(bench, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--out", "--quick", "--batches", "--contexts"):
        assert flag in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_full_run_without_cuda_exits_with_code_2(bench, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--out", str(tmp_path / "results")])
    assert exc.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "results").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke mode")
def test_quick_mode_writes_both_cache_dtypes_and_their_ratio(bench, tmp_path, monkeypatch):
    # The machine record is the harness's (tested there); a fixed one keeps this run hermetic.
    monkeypatch.setattr(bench, "machine_info", lambda: {"cpu_model": "test"})
    bench.main(["--quick", "--batches", "1,3", "--contexts", "40", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "fp8_decode.json").read_text())
    for key in ("schema", "command", "machine", "params", "oracle_check", "shapes", "verdict"):
        assert key in data, key
    assert data["mode"] == "quick" and data["errors"] == []
    assert data["oracle_check"]["ok"], data["oracle_check"]
    assert [(s["batch"], s["ctx"]) for s in data["shapes"]] == [(1, 40), (3, 40)]
    for shape in data["shapes"]:
        for kind in ("bf16", "fp8"):
            assert shape[kind]["finite"] and shape[kind]["ms"] > 0 and shape[kind]["tb_s"] > 0
        assert shape["fp8_over_bf16"] > 0
        assert 0 < shape["fp8_vs_bf16"] < 0.2  # quantized, but the same attention
    # bytes read at B 3: K and V (B x ctx x 2 x Hkv x D) in the cache dtype, Q and output
    q_and_out = 2 * 3 * 4 * 32 * 2
    for kind, item in (("bf16", 2), ("fp8", 1)):
        row = data["shapes"][1][kind]
        expected = 3 * 40 * 2 * 2 * 32 * item + q_and_out
        assert row["tb_s"] * row["ms"] * 1e9 == pytest.approx(expected, rel=1e-9)
    assert data["verdict"]["met"] is None  # the target shape (B 64, ctx 32k) was not run
