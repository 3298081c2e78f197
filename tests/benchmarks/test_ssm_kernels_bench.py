"""Smoke tests of `benchmarks/ssm_kernels.py` on the CPU: `--sections` picks the sections to
run and refuses an unknown one in one usage line with exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "ssm_kernels.py"


def test_sections_default_to_all_and_take_a_subset(bench):
    assert bench.parse_args([]).sections == list(bench.SECTIONS)
    assert bench.parse_args(["--sections", "scan, conv_prefill"]).sections == [
        "scan",
        "conv_prefill",
    ]


@pytest.mark.parametrize(("value", "named"), [("scan,foo", "foo"), (",", "(none)")])
def test_an_unknown_section_is_refused_in_one_line(bench, capsys, value, named):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--sections", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(
        "error: --sections: expected any of decode, scan, conv_prefill, conv_decode, got "
        + named
    )
