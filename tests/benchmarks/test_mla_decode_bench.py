"""Smoke tests of `benchmarks/mla_decode.py`: `--help`, the clear exit (code 2) of a full run
without CUDA, and the `--quick` CPU run (Triton's interpreter, tiny shapes) writing its JSON.
No timing assertions: the numbers depend on the machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "mla_decode.py"


def test_help(bench, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--out", "--quick", "--heads", "--batches", "--contexts", "--tiles"):
        assert flag in text


def test_bad_tiles_are_rejected(bench, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--quick", "--tiles", "16,1,16"])
    assert exc.value.code == 2
    assert "BH,BQ,BN,WARPS,STAGES" in capsys.readouterr().err


@pytest.mark.parametrize(("tiles", "message"), [
    ("64,1,64,8,2,1,4", "KERNEL 0: portable"),
    ("32,1,64,8,2,1,2", "the Hopper kernel takes block_h 64"),
])  # fmt: skip
def test_bad_kernel_choice_is_one_line_with_code_2(bench, capsys, tiles, message):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--quick", "--tiles", tiles])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_full_run_without_cuda_exits_with_code_2(bench, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--out", str(tmp_path / "results")])
    assert exc.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "results").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke mode")
def test_quick_mode_writes_expected_json(bench, tmp_path, monkeypatch):
    # The machine record is the harness's (tested there); a fixed one keeps this run hermetic.
    monkeypatch.setattr(bench, "machine_info", lambda: {"cpu_model": "test"})
    argv = ["--quick", "--batches", "1,2", "--contexts", "40", "--out", str(tmp_path)]
    bench.main(argv)
    data = json.loads((tmp_path / "mla_decode.json").read_text())
    for key in ("schema", "command", "machine", "params", "ceilings", "shapes", "verdicts"):
        assert key in data, key
    assert data["mode"] == "quick" and data["errors"] == []
    assert data["ceilings"]["copy"]["tb_s"] > 0
    assert data["oracle_check"]["ok"]
    assert [(s["heads"], s["batch"], s["ctx"]) for s in data["shapes"]] == [
        (16, 1, 40),
        (16, 2, 40),
    ]
    for shape in data["shapes"]:
        assert shape["latent_bytes"] == shape["batch"] * 40 * (64 + 16) * 4
        assert shape["best"]["tb_s"] > 0 and shape["best"]["pct_of_copy"] > 0
        for peer in ("gather_sdpa", "sdpa_dense"):
            assert shape[peer]["vs_ours"]["ok"], (peer, shape[peer])
            assert shape[peer]["ours_speedup"] > 0
    assert all(v["met"] for v in data["verdicts"])
    if data["png"]:
        assert Path(data["png"]).exists()


def test_l2_resident_reads_the_same_pages_for_every_request(bench, tmp_path):
    # The diagnostic keeps the peers' check: they read the same (shared) pages as ours.
    argv = ["--quick", "--batches", "2", "--contexts", "160", "--l2-resident", "--no-plot"]
    bench.main([*argv, "--out", str(tmp_path)])
    data = json.loads((tmp_path / "mla_decode.json").read_text())
    assert data["params"]["l2_resident"] is True and data["errors"] == []
    shape = data["shapes"][0]
    assert shape["gather_sdpa"]["vs_ours"]["ok"]


def test_l2_resident_block_table_cycles_over_eight_pages(bench):
    from mla_bench.config import QUICK
    from mla_bench.shape import L2_PAGES, Shape
    from mla_bench.timing import Bench

    gen = torch.Generator().manual_seed(0)
    params = {**QUICK, "l2_resident": True}
    shape = Shape(Bench(torch.device("cpu")), params, 16, 3, 16 * 20, gen)
    table = shape.block_table.cpu()
    assert table.shape == (3, 20)
    expected = torch.arange(20) % L2_PAGES + 1
    assert torch.equal(table, expected.expand(3, 20).to(table.dtype))


def test_an_fp8_latent_cache_counts_one_byte_per_element(bench, tmp_path):
    # --fp8: the kernel reads e4m3 latents; the oracle and the peers read them dequantized.
    argv = ["--quick", "--batches", "2", "--contexts", "40", "--fp8", "--no-plot"]
    bench.main([*argv, "--out", str(tmp_path)])
    data = json.loads((tmp_path / "mla_decode.json").read_text())
    assert data["params"]["fp8"] is True and data["errors"] == []
    assert data["oracle_check"]["ok"]
    shape = data["shapes"][0]
    assert shape["latent_bytes"] == 2 * 40 * (64 + 16)
    assert shape["gather_sdpa"]["vs_ours"]["ok"] and shape["sdpa_dense"]["vs_ours"]["ok"]
