"""Smoke tests of `benchmarks/v4_indexer.py` (a GPU benchmark): `--help` and the clear exit
without CUDA; on the CPU, its cases' key bytes (each request's seen entries, once). No timing
assertions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.benchmarks.smoke import assert_refuses_without_cuda

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "v4_indexer.py"


def test_help(bench, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    assert "--quick" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_a_run_without_cuda_exits_with_code_2(bench, tmp_path, capsys):
    assert_refuses_without_cuda(bench, tmp_path, capsys)
