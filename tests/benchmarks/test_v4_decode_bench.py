"""Smoke tests of `benchmarks/v4_decode.py` (a GPU benchmark): `--help`, `--configs` parsing
and its one-line refusal (exit 2), the clear exit without CUDA, and the step order of the
"both" graph. No timing assertions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.benchmarks.smoke import assert_refuses_without_cuda

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "v4_decode.py"


def test_help(bench, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--sweep", "--configs", "--rotations", "--topk"):
        assert flag in text


def test_configs_are_parsed_with_an_optional_register_cap(bench):
    assert bench.parse_configs("32/64/8/3/1,16/32/4/3/0/168,64/64/8/2/1/0/2") == [
        (32, 64, 8, 3, 1),
        (16, 32, 4, 3, 0, 168),
        (64, 64, 8, 2, 1, 0, 2),
    ]
    assert bench.parse_configs("") == bench.SWEEP
    configs = [
        bench.gather_config_of(c)
        for c in bench.parse_configs("32/64/8/3/1,16/32/4/3/0/168,64/64/8/2/1/0/0")
    ]
    assert [(c.max_registers, c.splits, c.index_ahead) for c in configs] == [
        (None, 1, True),
        (168, 1, False),
        (None, 0, True),
    ]


@pytest.mark.parametrize(
    "text", ["32/64/8/3", "32/64/8/3/2", "a/b/c/d/e", "0/64/8/3/1", "32/64/8/3/1/0/-1"]
)
def test_bad_configs_exit_with_code_2_and_one_line(bench, capsys, text):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--sweep", "--configs", text])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and "--configs takes BH/TILE/WARPS/STAGES/AHEAD[/MAXNREG[/SPLITS]]" in err
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_a_run_without_cuda_exits_with_code_2(bench, tmp_path, capsys):
    assert_refuses_without_cuda(bench, tmp_path, capsys)


def test_each_step_runs_its_window_then_its_compressed_launch(bench):
    calls = {"swa": ["w0", "w1"], "compressed": ["c0", "c1"]}
    assert bench.interleave(calls) == ["w0", "c0", "w1", "c1"]


def test_the_layer_touches_each_row_once_and_its_query_and_output_once(bench):
    # 2 tokens, 3 window rows and 5 top-k rows each, 4 heads of 16: rows (bf16) and their
    # entries (int64 block and slot, bool), the query read once, the output written once.
    step = {"q": torch.zeros(2, 4, 16), "swa": (None, torch.zeros(2, 3), None),
            "compressed": (None, torch.zeros(2, 5), None)}  # fmt: skip
    rows = 2 * (3 + 5)
    assert bench.layer_bytes(step, 16) == rows * 16 * 2 + 2 * (2 * 4 * 16 * 2) + rows * 17
