"""On a CUDA device the KV cache is sized as vLLM users expect: without `kv_cache_memory`,
`gpu_memory_utilization` of the device's free memory (not the CPU's 64 MiB default), and the
report says which rule applied."""

from __future__ import annotations

import pytest
import torch

from unified_attn import LLM, LLMEngine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_the_fraction_of_gpu_memory_sizes_the_cache():
    total = torch.cuda.mem_get_info()[1]
    llm = LLM("tiny-llama", device="cuda", gpu_memory_utilization=0.04)
    report = llm.llm_engine.kv_cache_report
    assert report.budget.startswith("gpu_memory_utilization=0.04 of the")
    assert 64 * 2**20 < report.total_bytes <= 0.04 * total
    (out,) = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4


def test_a_given_budget_wins_over_the_fraction():
    engine = LLMEngine("tiny-llama", device="cuda", kv_cache_memory="32MiB")
    report = engine.kv_cache_report
    assert report.budget == "kv_cache_memory=32.0 MiB" and report.total_bytes <= 32 * 2**20
