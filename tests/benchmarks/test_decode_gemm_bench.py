"""Smoke tests of `benchmarks/decode_gemm.py` on the CPU (the kernels in Triton's interpreter,
small float32 layers): the two paths of a layer give the same hidden states, and the script
refuses to run without CUDA."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.benchmarks.smoke import assert_refuses_without_cuda

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_gemm.py"


def test_the_two_paths_agree(bench, monkeypatch):
    for name, value in (("HIDDEN", 64), ("QKV", 96), ("INTER", 80), ("DEVICE", "cpu"),
                        ("DTYPE", torch.float32)):  # fmt: skip
        monkeypatch.setattr(bench, name, value)
    layers = [bench.Layer(seed) for seed in range(2)]
    x = torch.randn(3, 64)
    outs = {path: torch.empty_like(x) for path in bench.PATHS}
    for path in bench.PATHS:
        bench.run_model(path, layers, x, outs[path])
    torch.testing.assert_close(outs["skinny"], outs["library"], rtol=1e-5, atol=1e-5)


def test_refuses_without_cuda(bench, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    assert_refuses_without_cuda(bench, tmp_path, capsys)


def test_the_json_header_records_the_library_switches(bench, monkeypatch):
    """`common.run_header`: a run with the decode-row GEMM off says so in its JSON."""
    monkeypatch.setenv("UNIFIED_ATTN_SKINNY_GEMM", "0")
    monkeypatch.setenv("UNRELATED_VARIABLE", "1")
    header = bench.run_header(bench.SCHEMA, "decode_gemm.py", False, [])
    assert header["switches"].get("UNIFIED_ATTN_SKINNY_GEMM") == "0"
    assert "UNRELATED_VARIABLE" not in header["switches"]
