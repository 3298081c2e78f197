"""Smoke tests of `benchmarks/decode_fixed_cost.py`: `--help`, the clear exit (code 2) of a GPU
run without CUDA, the `--quick --device cpu` run (Triton's interpreter, tiny float16 shapes, no
graphs, no peer) writing its JSON with the timings, the reference check and the host-time
split; the vLLM call's thresholds and cache layout (`decode_peer_calls.py`, no vLLM needed);
and, where `benchmarks/peers/vllm_attn` exists, vLLM's op against ours in the interpreter. No
timing assertions: interpreter numbers say nothing about a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from .smoke import assert_refuses_without_cuda

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_fixed_cost.py"
PEERS = SCRIPT.parent / "peers" / "vllm_attn" / "triton_unified_attention.py"
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke mode")


def test_help(bench, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--out", "--quick", "--device", "--batches", "--contexts", "--profile-host",
                 "--no-peer", "--baseline", "--vllm-kv-layout"):  # fmt: skip
        assert flag in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_gpu_run_without_cuda_exits_with_code_2(bench, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert_refuses_without_cuda(bench, tmp_path, capsys)


@CPU_ONLY
def test_quick_cpu_run_writes_the_fields(bench, tmp_path):
    bench.main(["--quick", "--device", "cpu", "--profile-host", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "decode_fixed_cost.json").read_text())
    for key in ("schema", "mode", "command", "machine", "timestamp_utc", "params", "shapes"):
        assert key in data, key
    assert data["schema"] == bench.SCHEMA and data["mode"] == "quick"
    assert data["errors"] == [] and data["device"] == "cpu"
    assert data["vllm_peer"] is False and "peer_note" in data
    assert data["copy_tb_s"] is None and data["verdict"]["met"] is None
    p = data["params"]
    assert [(r["batch"], r["ctx"]) for r in data["shapes"]] == [(1, 40), (3, 40), (1, 1100),
                                                                (3, 1100)]  # fmt: skip
    for row in data["shapes"]:
        ours = row["ours"]
        assert ours["eager_us"] > 0 and ours["host_submit_us"] > 0 and "graph_us" not in ours
        assert row["finite"]["ours"] and row["diff"]["ours_vs_ref"]["ok"]
        assert row["diff"]["ours_vs_ref"]["max_abs_err"] < 5e-3
        expected = row["batch"] * row["ctx"] * 2 * p["kv_heads"] * p["head_size"] * 2
        assert row["kv_bytes"] == expected
        assert row["bytes_read"] == expected + 2 * row["batch"] * p["heads"] * p["head_size"] * 2
        assert row["ref_requests"] == list(range(row["batch"]))
        # the interpreter has 4 "SMs": 1100 keys split, 40 do not
        assert (row["split"] is not None) == (row["ctx"] == 1100)
    prof = data["host_profile"]
    assert (prof["batch"], prof["ctx"]) == (1, 1100)
    for piece in ("plan_split", "scratch_ensure", "launcher_stubbed", "stub_launches",
                  "attention_launch", "merge_launch", "call_host", "eager_wall"):  # fmt: skip
        assert prof["pieces"][piece]["median_us"] > 0, piece
    assert "error" in prof["pieces"]["attention_driver_launch"]  # no compiled kernel here
    assert prof["derived"]["python_checks_us"] > 0 and prof["derived"]["per_step_us"] > 0


def test_baseline_check_flags_slower_shapes(bench, tmp_path):
    import decode_report

    old = {"shapes": [{"batch": 1, "ctx": 4096, "ours": {"eager_us": 100.0, "graph_us": 40.0}},
                      {"batch": 4, "ctx": 4096, "ours": {"eager_us": 100.0}}]}  # fmt: skip
    (tmp_path / "old.json").write_text(json.dumps(old))
    rows = [{"batch": 1, "ctx": 4096, "ours": {"eager_us": 70.0, "graph_us": 41.0}},
            {"batch": 4, "ctx": 4096, "ours": {"eager_us": 110.0}},
            {"batch": 16, "ctx": 4096, "ours": {"eager_us": 1.0}}]  # fmt: skip
    check = decode_report.baseline_check(rows, str(tmp_path / "old.json"))
    ratios = [(s["batch"], s["eager_now_over_then"]) for s in check["shapes"]]
    assert ratios == [(1, 0.7), (4, 1.1)]
    assert [s["batch"] for s in check["slower"]] == [4] and not check["no_shape_slower"]


def test_vllm_call_thresholds_and_layout(bench):
    import decode_peer_calls as calls

    assert calls.seq_threshold_3d(8) == 16 and calls.seq_threshold_3d(2) == 64
    scratch = calls.vllm_scratch(32, 8, 128, torch.device("cpu"))
    assert scratch.output.shape == (16, 32, 16, 128) and scratch.max.shape == (16, 32, 16)
    assert calls.uses_3d(16, 32, 8, scratch) and not calls.uses_3d(17, 32, 8, scratch)
    cache = torch.randn(3, 2, 16, 8, 128)
    k, v = calls.vllm_kv_cache(cache)
    assert torch.equal(k, cache[:, 0]) and torch.equal(v, cache[:, 1])
    assert k.stride() == (16 * 8 * 256, 8 * 256, 256, 1)  # K and V of a head side by side


@CPU_ONLY
@pytest.mark.skipif(not PEERS.exists(), reason="no benchmarks/peers/vllm_attn (vllm_peers.py)")
def test_vllm_op_agrees_with_ours_in_the_interpreter(bench):
    import decode_peer_calls as calls
    from attn_bench.timing import rel_err

    op = calls.load_vllm_attn()
    p = dict(bench.QUICK_CPU)
    torch.manual_seed(0)
    case = bench.Case(p, 2, 40, torch.device("cpu"), 1)
    ours, out, _ = bench.ours_calls(case)
    ours[0]()
    vllm, vout, info = calls.vllm_calls(case, op, "vllm")
    vllm[0]()
    assert info["path"] == "3D" and info["kv_layout"] == "vllm"
    ref = bench.reference(case, [0, 1])
    assert rel_err(vout, ref)["max_abs_err"] < 5e-3
    assert rel_err(out, vout)["max_abs_err"] < 5e-3
