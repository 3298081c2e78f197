"""Smoke tests of `benchmarks/v4_engine_decode.py` (a GPU benchmark): `--help`, the one-line
refusal of bad arguments (exit 2), the clear exit without CUDA, and the model it registers
(V4's attention shape). No timing assertions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.benchmarks.smoke import assert_refuses_without_cuda
from unified_attn.models import V4_PRESETS

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "v4_engine_decode.py"


def test_help(bench, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--batches", "--context", "--steps", "--quick"):
        assert flag in text


@pytest.mark.parametrize(
    "args",
    [["--batches", "8,x"], ["--batches", "0"], ["--steps", "2"], ["--max-model-len", "100"]],
)
def test_bad_arguments_exit_with_code_2_and_one_line(bench, capsys, args):
    with pytest.raises(SystemExit) as exc:
        bench.main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--batches takes positive ints" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_a_run_without_cuda_exits_with_code_2(bench, tmp_path, capsys):
    assert_refuses_without_cuda(bench, tmp_path, capsys)


def test_the_registered_model_has_deepseek_v4_attention_shapes(bench, monkeypatch):
    monkeypatch.setattr(bench, "V4_PRESETS", dict(V4_PRESETS))
    bench.register_shape()
    config = bench.V4_PRESETS[bench.SHAPE]
    assert (config.num_heads, config.head_dim, config.qk_rope_head_dim) == (64, 512, 64)
    assert (config.sliding_window, config.csa_compress_rate, config.hca_compress_rate) == (
        128, 4, 128)  # fmt: skip
    assert (config.index_n_heads, config.index_head_dim, config.index_topk) == (64, 128, 512)
    assert set(config.layer_types) == {bench.SLIDING, bench.CSA, bench.HCA}
    assert bench.SHAPE not in V4_PRESETS  # registered in the benchmark's process only
