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


def test_busy_time_is_the_union_of_the_intervals(bench):
    assert bench.busy_us([]) == 0.0
    assert bench.busy_us([(0.0, 4.0), (2.0, 5.0), (7.0, 8.0), (7.5, 7.8)]) == 6.0


def test_step_timeline_splits_span_busy_idle_and_the_kernels_outside_the_graph(bench):
    events = [(0.0, 10.0, "gemm_a"), (10.0, 11.0, "argmax"), (14.0, 24.0, "gemm_a"),
              (24.0, 25.0, "argmax"), (25.0, 27.0, "Memcpy HtoD")]  # fmt: skip
    line = bench.step_timeline(events, steps=2, graph_kernels={"gemm_a"})
    assert (line["span_us"], line["busy_us"], line["idle_us"]) == (13.5, 12.0, 1.5)
    assert line["outside_graph"] == [
        {"kernel": "argmax", "group": "other", "calls": 1.0, "us_per_call": 1.0, "us": 1.0},
        {"kernel": "Memcpy HtoD", "group": "other", "calls": 0.5, "us_per_call": 2.0, "us": 1.0},
    ]
    assert bench.step_timeline([], 3, set())["busy_us"] == 0.0


def test_a_negative_engine_steps_is_refused_in_one_line(bench, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--engine-steps", "-1"])
    assert exc.value.code == 2
    assert "--engine-steps: 0 or more, got -1" in capsys.readouterr().err
