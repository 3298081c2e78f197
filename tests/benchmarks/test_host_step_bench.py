"""Smoke test of `benchmarks/host_step.py --quick`: it runs, with the byte tokenizer and with a
trained BPE (both detokenizers), and writes the expected JSON; a bad `--tokenizer` is refused in
one line. No timing assertions: the numbers depend on the machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "host_step.py"


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_quick_mode_writes_every_phase(bench, tmp_path, tokenizer):
    bench.main(["--quick", "--tokenizer", tokenizer, "--out", str(tmp_path)])
    data = json.loads((tmp_path / "host_step.json").read_text())
    assert data["mode"] == "quick" and data["tokenizer"] == tokenizer
    detokenizers = {"bytes": {"windows"}, "bpe": {"stream", "windows"}}[tokenizer]
    rows = data["results"]
    assert {(r["requests"], r["output_kind"], r["detokenizer"]) for r in rows} == {
        (n, kind, d) for n in (8, 16) for kind in ("DELTA", "FINAL_ONLY") for d in detokenizers
    }
    for r in rows:
        assert set(r["us"]) == set(bench.PHASES)
        assert all(r["us"][p]["n"] == r["steps"] for p in ("schedule", "update", "step"))
        assert r["us"]["step"]["median"] > r["us"]["outputs"]["median"] > 0


def test_a_bad_tokenizer_is_refused_in_one_line(bench, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--quick", "--tokenizer", str(tmp_path / "none"), "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "--tokenizer: expected bytes, bpe or a directory with tokenizer files" in (
        capsys.readouterr().err
    )
