"""Decoder checkpoints on the GPU (run through the device tool), in eager prefill and in decode
steps replayed from CUDA graphs, against transformers' greedy tokens and logits in float32 (the
CPU parity tests check the reference path the same way): GPT-OSS, Mixtral, Qwen2-MoE, Qwen3-MoE
and DeepSeek-V3 with their experts grouped (`kernels/moe/grouped_experts.py`), and every
Llama-line family with the fused layers (`kernels/layers`: packed q/k/v and gate/up GEMMs, norms
with their residual adds, gated activations, RoPE in place; Llama, Qwen 3's q/k norms, Gemma 2
and 3's norms and GeGLU, Phi-3's fused projections, Llama 4's interleaved RoPE and NoPE layer)."""

from __future__ import annotations

import pytest
import torch

from tests.models.hf_models import (
    hf_greedy,
    hf_logits,
    make_family_model,
    make_hf_model,
    save_hf_model,
)
from tests.models.test_deepseek_hf import make_deepseek
from unified_attn import LLMEngine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def fused_layers_on(monkeypatch):
    """Models built on CUDA run the fused layers (the default; set here so that an environment
    that turns them off does not skip these checks)."""
    monkeypatch.setenv("UNIFIED_ATTN_FUSED_LAYERS", "1")


PROMPTS = [[(5 * i + 3 * j) % 90 + 4 for j in range(n)] for i, n in enumerate([37, 12, 64])]


MOE = ["gpt-oss", "mixtral", "qwen2-moe", "qwen3-moe", "deepseek-v3"]
DENSE = ["llama", "qwen3", "gemma2", "gemma3", "phi3", "llama4"]


def make(family):
    if family == "deepseek-v3":
        return make_deepseek("v3")
    if family == "llama":
        return make_hf_model("llama", num_hidden_layers=2)
    return make_family_model(family)


@pytest.mark.parametrize("family", MOE + DENSE)
def test_grouped_experts_and_fused_layers_give_transformers_tokens_and_logits(family, tmp_path):
    hf = make(family)
    path = save_hf_model(hf, tmp_path / family)
    engine = LLMEngine(str(path), device="cuda", dtype="float32", max_num_seqs=4,
                       max_model_len=128, kv_cache_memory="64MiB")  # fmt: skip
    params = SamplingParams(max_tokens=12, ignore_eos=True, return_logits=True)
    outputs = engine.generate(PROMPTS, params)
    assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.output_token_ids == hf_greedy(hf, prompt, 12)
        # each generated token's logits: transformers' row before it over prompt + output
        want = hf_logits(hf, prompt + out.output_token_ids)[len(prompt) - 1 : -1]
        torch.testing.assert_close(torch.stack(list(out.logits)).float().cpu(), want,
                                   rtol=1e-3, atol=1e-3)  # fmt: skip
