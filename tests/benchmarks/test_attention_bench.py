"""Smoke tests of `benchmarks/attention.py` that need no GPU: import, `--help`, and the clear
exit (code 2) without CUDA. The benchmark itself only runs on the GPU machine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "attention.py"


def test_module_imports(bench):
    assert callable(bench.main)
    assert set(bench.SECTIONS) == {"decode", "prefill", "window", "features", "split"}


def test_help(bench, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--out", "--quick", "--sections", "--budget-s", "--no-flex"):
        assert flag in text


def test_unknown_section_is_rejected(bench, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--sections", "decode,bogus"])
    assert exc.value.code == 2
    assert "bogus" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_cpu_exits_with_code_2(bench, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--quick", "--out", str(tmp_path / "results")])
    assert exc.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "results").exists()
