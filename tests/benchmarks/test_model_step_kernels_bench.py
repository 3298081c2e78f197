"""Smoke tests of `benchmarks/model_step_kernels.py` on the CPU: kernel names fall into their
groups, one replay's kernels add up per name, and the script refuses to run without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.smoke import assert_refuses_without_cuda

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "model_step_kernels.py"


@pytest.mark.parametrize("name,group", [
    ("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_splitK_TNT", "GEMM"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", "GEMM"),
    ("unified_attention_kernel", "attention"),
    ("merge_segments_kernel", "attention"),
    ("rms_norm_kernel", "norm"),
    ("rotary_kernel", "rotary"),
    ("act_and_mul_kernel", "activation"),
    ("write_kv_cache_kernel", "KV write"),
    ("void at::native::vectorized_gather_kernel<16, long>", "other"),
])  # fmt: skip
def test_kernel_groups(bench, name, group):
    assert bench.group_of(name) == group


def test_breakdown_sums_each_kernel_name(bench):
    rows = bench.breakdown([("rms_norm_kernel", 2.0), ("gemm_a", 10.0), ("rms_norm_kernel", 4.0)])
    assert rows == [
        {"kernel": "gemm_a", "group": "GEMM", "calls": 1, "us_per_call": 10.0, "us": 10.0},
        {"kernel": "rms_norm_kernel", "group": "norm", "calls": 2, "us_per_call": 3.0, "us": 6.0},
    ]


def test_refuses_without_cuda(bench, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    assert_refuses_without_cuda(bench, tmp_path, capsys)
