"""Tensor parallelism on 2 CUDA devices (NCCL): graphs with all-reduces inside replay, and float32
tokens equal one device's."""

from __future__ import annotations

import pytest
import torch

from tests.models.hf_models import save_hf_model
from tests.runner.test_async_scheduling import ENGINE
from tests.runner.test_tensor_parallel_state import CHECKPOINTS as STATE_CHECKPOINTS
from tests.runner.test_tp_overlap import serve, tight_memory
from unified_attn import LLMEngine, SamplingParams
from unified_attn.runner.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 6, list(range(30, 90)), [3, 4] * 20]


@pytest.mark.parametrize("preset", ["tiny-llama", "gemma2-like"])
def test_two_ranks_give_the_tokens_of_one_device_in_float32(preset):
    assert_two_ranks_give_one_devices_tokens(preset)


def assert_two_ranks_give_one_devices_tokens(model: str) -> None:
    """Two ranks in float32 (decode replaying CUDA graphs) against one device, greedy tokens."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    options = dict(device="cuda", dtype="float32", gpu_memory_utilization=0.3)
    want = LLMEngine(model, **options).generate(PROMPTS, params)
    engine = LLMEngine(model, tensor_parallel_size=2, **options)
    try:
        got = engine.generate(PROMPTS, params)
        assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0
    finally:
        engine.shutdown()
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]


@pytest.mark.parametrize("preset", ["deepseek-v3-like", "deepseek-v4-like"])
def test_deepseek_ranks_on_the_triton_kernels_give_the_tokens_of_one_device(preset):
    """MLA and V4 shards: each rank's Triton backends see its local heads over the replicated
    latent caches (MLA decode replays graphs)."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    options = dict(device="cuda", dtype="float32", gpu_memory_utilization=0.3)
    single = LLMEngine(preset, **options)
    want = single.generate(PROMPTS, params)
    backend = single.backend_cls
    del single
    engine = LLMEngine(preset, tensor_parallel_size=2, **options)
    try:
        got = engine.generate(PROMPTS, params)
        assert engine.backend_cls is backend and backend.name.startswith("triton")
    finally:
        engine.shutdown()
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]


@pytest.mark.parametrize("family", ["mamba2-one-group", "nemotron-h-moe", "qwen3-next"])
def test_state_layer_ranks_on_the_triton_kernels_give_the_tokens_of_one_device(family, tmp_path):
    """Mamba-2 (one group: replicated B and C, the gated norm's all-reduce) and gated delta-net
    shards on the SSM kernels; decode replays graphs with the all-reduces inside."""
    assert_two_ranks_give_one_devices_tokens(
        str(save_hf_model(STATE_CHECKPOINTS[family](), tmp_path / family))
    )


def test_two_ranks_overlap_steps_with_the_tokens_of_one_device(monkeypatch):
    """Overlapped steps on two ranks (NCCL, CUDA graphs; tests/runner/test_tp_overlap.py's
    workload: preemption, aborts, a stop token, greedy, seeded and unseeded sampling, with plain
    steps that sample randomly before and between overlapped ones): every rank samples rank 0's
    ids on its device, so all tokens equal one device's overlapped steps; rank 0's launches never
    wait for the device (torch's sync debug mode)."""
    launches = []
    launch = ModelRunner.launch

    def strict_launch(self, output, *args, **kwargs):
        launches.append(bool(output.scheduled))
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(self, output, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    options = dict(device="cuda", dtype="float32")
    memory = tight_memory("tiny-llama", **options)
    one = LLMEngine("tiny-llama", kv_cache_memory=memory, async_scheduling=True, **ENGINE,
                    **options)  # fmt: skip
    want = serve(one)
    del one
    monkeypatch.setattr(ModelRunner, "launch", strict_launch)
    # a rank holds one of the 2 KV heads: half the bytes give one device's blocks
    engine = LLMEngine("tiny-llama", tensor_parallel_size=2, kv_cache_memory=memory // 2,
                       async_scheduling=True, **ENGINE, **options)  # fmt: skip
    try:
        got = serve(engine)
        assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0
        assert engine.scheduler.num_preemptions > 0
    finally:
        engine.shutdown()
    assert sum(launches) >= 10
    assert got == want
