"""Smoke tests of `benchmarks/mla_projections.py` (a GPU benchmark): `--help`, the clear exit
without CUDA, and that its two formulations compute the same products (float32 on the CPU, so
they agree to rounding). No timing assertions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "mla_projections.py"


def test_help(bench, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    assert "--quick" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_cuda_it_exits_with_code_2_and_one_line(bench, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--quick"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_the_two_formulations_compute_the_same_products(bench):
    gen = torch.Generator().manual_seed(0)
    heads, tokens = 4, 3
    q = torch.randn(tokens, heads, bench.NOPE + bench.ROPE, generator=gen)
    latent = torch.randn(tokens, heads, bench.LATENT, generator=gen)
    w_uk = torch.randn(heads, bench.NOPE, bench.LATENT, generator=gen)
    w_uv = torch.randn(heads, bench.LATENT, bench.V_HEAD, generator=gen)
    before = bench.as_before(q, w_uk, latent, w_uv)
    now = bench.as_now(q, w_uk, latent, w_uv)
    for a, b in zip(before, now, strict=True):
        torch.testing.assert_close(a, b)
    assert now[0].shape == (tokens, heads, bench.LATENT + bench.ROPE)


def test_the_chart_is_written_when_matplotlib_is_installed(bench, tmp_path):
    rows = [{"heads": 128, "tokens": 64, "float32_weights_us": 178.2, "model_dtype_us": 30.8}]
    result = {"rows": rows, "dtype": "bfloat16", "machine": {"gpu": "test"}}
    bench.plot(result, tmp_path / "chart.png")  # without matplotlib: a note, no file
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (tmp_path / "chart.png").exists()
    else:
        assert (tmp_path / "chart.png").stat().st_size > 0
