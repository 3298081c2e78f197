"""Checks every GPU benchmark script's smoke tests share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


def assert_refuses_without_cuda(bench: Any, tmp_path: Path, capsys: Any) -> None:
    """Without CUDA the script exits with code 2 and one line saying so, writing nothing."""
    with pytest.raises(SystemExit) as exc:
        bench.main(["--out", str(tmp_path / "results")])
    assert exc.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "results").exists()
