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


def test_prefill_rows_time_ours_and_the_peer_in_turn(bench, monkeypatch):
    """`paired_ms` alternates the sides round by round, and a row reports each side's median."""
    import common

    calls = []
    times = iter([5.0, 9.0, 1.0, 8.0, 3.0, 7.0])  # ours, vllm, ours, vllm, ...

    def fake_gpu_ms(fn):
        calls.append(fn())
        return next(times)

    monkeypatch.setattr(common, "gpu_ms", fake_gpu_ms)
    monkeypatch.setattr(bench, "warm_up_gpu", lambda: None)
    row = bench.paired_row([2048], lambda: "ours", lambda: "vllm")
    assert calls == ["ours", "vllm"] * 3
    assert row["rounds_ms"] == {"ours": [5.0, 1.0, 3.0], "vllm": [9.0, 8.0, 7.0]}
    assert (row["ours_ms"], row["vllm_ms"], row["vllm_over_ours"]) == (3.0, 8.0, 8.0 / 3.0)
