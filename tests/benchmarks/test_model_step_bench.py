"""Smoke tests of `benchmarks/model_step.py` on the CPU: one configuration of tiny-llama runs
in its own process and the JSON holds every field with sane values; the step accounting of a
MoE rank; the sentinel step of the graph replays; bad options. No timing assertions beyond
"positive": the numbers depend on the machine."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.benchmarks.smoke import assert_refuses_without_cuda
from unified_attn import LLMEngine
from unified_attn.models.presets import PRESETS

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "model_step.py"
DECODE_FIELDS = ("batch", "steps", "mean_context", "wall_step_ms", "device_step_ms",
                 "host_overhead_ms", "tokens_per_s", "bytes_per_step", "flops_per_step",
                 "roofline_ms", "roofline_bound", "roofline_fraction",
                 "device_roofline_fraction", "tp_speedup")  # fmt: skip
PREFILL_FIELDS = ("tokens", "step_ms", "tokens_per_s", "flops_per_step", "tflops",
                  "matmul_fraction")  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _restore_presets():
    """Importing the script registers its shapes; other modules see the presets as they were."""
    before = dict(PRESETS)
    yield
    PRESETS.clear()
    PRESETS.update(before)


def test_cpu_run_writes_every_field(bench, tmp_path):
    argv = ["--device", "cpu", "--models", "tiny-llama", "--tp", "1", "--batches", "1,4",
            "--prompt-len", "16", "--warmup", "1", "--steps", "3", "--prefill", "32,64",
            "--prefill-reps", "1", "--no-plot", "--out", str(tmp_path)]  # fmt: skip
    bench.main(argv)
    data = json.loads((tmp_path / "model_step.json").read_text())
    assert data["schema"] == "model_step/1" and "machine" in data
    assert set(data["environment"]) == set(bench.NCCL_ENVIRONMENT)  # set where absent
    [config] = data["configs"]
    assert "error" not in config, config
    assert (config["model"], config["tp"], config["cuda_graphs"]) == ("tiny-llama", 1, False)
    assert all(v > 0 for v in config["ceilings"].values())
    assert config["rank_weights"]["bytes"] == 4 * (737280 + 49152 + 1152)  # float32 tiny-llama
    assert [r["batch"] for r in config["decode"]] == [1, 4]
    for row in config["decode"]:
        assert set(DECODE_FIELDS) <= set(row)
        assert row["pure_decode"] and row["steps"] == 3
        assert row["wall_step_ms"] > 0 and row["tokens_per_s"] > 0 and row["roofline_ms"] > 0
        assert math.isclose(row["roofline_fraction"], row["roofline_ms"] / row["wall_step_ms"])
        assert row["device_step_ms"] is None and row["host_overhead_ms"] is None  # no graphs
        assert row["mean_context"] == 16 + 1 + 1 + (3 - 1) / 2  # prompt, first token, warm-up
        assert row["tp_speedup"] == 1.0
    for row, tokens in zip(config["prefill"], (32, 64), strict=True):
        assert set(PREFILL_FIELDS) <= set(row)
        assert row["tokens"] == row["tokens_in_step"] == tokens  # the whole prompt in one step
        assert row["step_ms"] > 0 and row["matmul_fraction"] > 0


def test_moe_rank_counts_the_experts_a_step_touches(bench):
    from model_step_shapes import attention_shape, decode_cost, prefill_flops, rank_weights

    engine = LLMEngine("tiny-qwen3-moe", device="cpu", max_model_len=256, kv_cache_memory="1MiB")
    config = PRESETS["tiny-qwen3-moe"]
    w = rank_weights(engine.model, config)
    attn = attention_shape(engine.kv_cache_report, config, tp=1)
    assert w.expert_share == 0.5 and w.experts == 4 * 4 * 3 * 64 * 128  # layers, experts, mats
    assert w.head == 384 * 128  # tied: the embedding is the head
    one, many = decode_cost(w, attn, 1, 100), decode_cost(w, attn, 64, 100)
    assert one.bytes < many.bytes <= w.bytes + 64 * 100 * attn.kv_bytes_per_token
    assert many.flops == pytest.approx(64 * one.flops)  # FLOPs grow with the batch
    dense = 2 * 10 * (w.dense + w.experts / 2) + 2 * w.head
    assert prefill_flops(w, attn, 10) == dense + attn.flops_per_pair * 55


def test_replay_sentinel_round_trips(bench):
    from model_step_device import replay_output, replay_request

    assert replay_request(replay_output(64, 50)) == (64, 50)
    assert replay_request(type(replay_output(1, 1))([], [], ["req-1"])) is None


def test_decode_requests_may_read_their_outputs(bench, tmp_path):
    """`--repetition-penalty`: the decode requests' sampling reads their outputs (overlapped
    steps then append the token in flight), recorded with the run's settings."""
    argv = ["--device", "cpu", "--models", "tiny-llama", "--tp", "1", "--batches", "2",
            "--prompt-len", "8", "--warmup", "1", "--steps", "2", "--prefill", "16",
            "--prefill-reps", "1", "--repetition-penalty", "1.3", "--no-plot",
            "--out", str(tmp_path)]  # fmt: skip
    bench.main(argv)
    data = json.loads((tmp_path / "model_step.json").read_text())
    assert data["settings"]["repetition_penalty"] == 1.3
    [config] = data["configs"]
    assert "error" not in config and config["decode"][0]["wall_step_ms"] > 0


def test_bad_options_are_named(bench, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--device", "cpu", "--batches", "1,x"])
    assert exc.value.code == 2
    assert "--batches: positive integers separated by commas" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--models", "llama-9000"])
    assert "--models: unknown llama-9000" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--steps", "0"])
    assert "--steps must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--repetition-penalty", "0"])
    assert "--repetition-penalty must be > 0, got 0.0" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_a_run_without_cuda_exits_with_code_2(bench, tmp_path, capsys):
    assert_refuses_without_cuda(bench, tmp_path, capsys)
