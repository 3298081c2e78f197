"""Smoke tests of `benchmarks/tune_skinny_gemm.py` on the CPU: the tile grids (the defaults of
`skinny_tiles` inside the quick one), the best-tile report, the refusal of bad options in one
usage line with exit code 2, and the refusal without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.benchmarks.smoke import assert_refuses_without_cuda
from unified_attn.kernels.layers.skinny_gemm import skinny_tiles

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tune_skinny_gemm.py"


def test_the_quick_grid_holds_every_default_tile(bench):
    quick, full = bench.candidates(quick=True), bench.candidates(quick=False)
    assert len(quick) == 16 and set(quick) <= set(full)
    for n, k in bench.SHAPES.values():
        assert skinny_tiles(n, k, torch.bfloat16) in quick


def test_the_report_picks_the_best_tile_over_the_row_counts(bench, capsys):
    def row(rows, a, b):
        return {"shape": "o", "rows": rows, "ideal_ms": 1.0, "default": "a",
                "best": "a" if a <= b else "b", "ms": {"cublas": 2.0, "a": a, "b": b}}  # fmt: skip

    # b: twice as fast at one row, 2.5x slower at 16: the default a wins over both
    bench.report([row(1, 2.0, 1.0), row(16, 2.0, 5.0)])
    out = capsys.readouterr().out
    assert "o: best over the row counts a (1.00x the default's time)" in out
    assert "rows  1: default a 50%, best b 100%, cuBLAS 50% of the copy time" in out
    assert "rows 16: default a 50%, best a 50%, cuBLAS 50% of the copy time" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--rows", "1,65"], "--rows: at most 64"),
    (["--shapes", "qkv,lm_head"], "--shapes: expected any of qkv, o, gate_up, down, got lm_head"),
])  # fmt: skip
def test_bad_options_are_refused_in_one_line(bench, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_refuses_without_cuda(bench, capsys, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    assert_refuses_without_cuda(bench, None, capsys)
