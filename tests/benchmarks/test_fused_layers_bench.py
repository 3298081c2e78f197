"""Smoke tests of `benchmarks/fused_layers.py` (a GPU benchmark): `--help`, bad options named with
exit code 2, and the clear exit without CUDA. No timing assertions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.benchmarks.smoke import assert_refuses_without_cuda

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fused_layers.py"


def test_help(bench, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    assert "--cases" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cases", "softmax"], "--cases: unknown case 'softmax'; choose from rms_norm"),
        (["--tokens", "8,x"], "--tokens must be positive integers separated by commas"),
        (["--tokens", "0"], "--tokens must be positive integers"),
    ],
)
def test_bad_options_are_named(bench, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_a_run_without_cuda_exits_with_code_2(bench, tmp_path, capsys):
    assert_refuses_without_cuda(bench, tmp_path, capsys)
