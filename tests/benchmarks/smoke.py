"""Checks every GPU benchmark script's smoke tests share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


def assert_refuses_without_cuda(bench: Any, tmp_path: Path | None, capsys: Any) -> None:
    """Without CUDA the script exits with code 2 and one line saying so, writing nothing
    (`tmp_path` None: a script that writes no files, run without options)."""
    with pytest.raises(SystemExit) as exc:
        bench.main([] if tmp_path is None else ["--out", str(tmp_path / "results")])
    assert exc.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert tmp_path is None or not (tmp_path / "results").exists()
