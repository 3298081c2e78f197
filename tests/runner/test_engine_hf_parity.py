"""The engine against transformers on saved checkpoints: prompt logits, sampled-position logits
and 32 greedy tokens, for mixed prompt lengths, chunked prefill and prefix-cache hits."""

import pytest
import torch

from tests.models.hf_models import hf_logits, make_hf_model, save_hf_model
from tests.models.test_hf import LLAMA3
from tests.models.test_hf_families import make_family_model
from unified_attn import LLMEngine, SamplingParams

CASES = {
    "llama": ("llama", dict(num_hidden_layers=2, rope_parameters=LLAMA3)),
    "qwen2": ("qwen2", dict(num_hidden_layers=2)),
    "mistral-window": ("mistral", dict(num_hidden_layers=2, sliding_window=12)),
    "gemma2": ("family", {}),  # window 8, soft caps, Gemma norms
    "gpt-oss": ("family", {}),  # window 8, learned sinks, MoE, YaRN
}
NUM_TOKENS = 32


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    model_type, overrides = CASES[request.param]
    if model_type == "family":
        hf = make_family_model(request.param)
    else:
        hf = make_hf_model(model_type, **overrides)
    return hf, save_hf_model(hf, tmp_path_factory.mktemp(request.param))


def prompts(lengths, seed=0, shared=0):
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 128, (shared,), generator=gen).tolist()
    return [prefix + torch.randint(0, 128, (n,), generator=gen).tolist() for n in lengths]


def check_against_hf(hf, outputs, batch, prompt_logits):
    for prompt, out in zip(batch, outputs, strict=True):
        full = hf_logits(hf, prompt + out.output_token_ids)  # [P + N, V]
        expected_tokens = full[len(prompt) - 1 : -1].argmax(-1).tolist()
        assert out.output_token_ids == expected_tokens
        sampled = full[len(prompt) - 1 : len(prompt) - 1 + NUM_TOKENS]
        assert (out.logits - sampled).abs().max() < 1e-4
        if prompt_logits:
            assert (out.prompt_logits - full[: len(prompt)]).abs().max() < 1e-4


@pytest.mark.parametrize("budget", [4096, 16], ids=["one-step-prefill", "chunked-prefill"])
def test_mixed_batch_matches_transformers(checkpoint, budget):
    hf, path = checkpoint
    engine = LLMEngine(str(path), max_num_batched_tokens=budget, block_size=8)
    batch = prompts([23, 5, 40, 1, 17])
    params = SamplingParams(
        max_tokens=NUM_TOKENS, ignore_eos=True, prompt_logits=True, return_logits=True
    )
    check_against_hf(hf, engine.generate(batch, params), batch, prompt_logits=True)


def test_prefix_cache_hits_match_transformers(checkpoint):
    hf, path = checkpoint
    engine = LLMEngine(str(path), max_num_batched_tokens=64, block_size=8)
    params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, return_logits=True)
    first = prompts([3], seed=1, shared=40)
    check_against_hf(hf, engine.generate(first, params), first, prompt_logits=False)
    batch = prompts([9, 2, 30], seed=1, shared=40)  # the same 40-token prefix
    check_against_hf(hf, engine.generate(batch, params), batch, prompt_logits=False)
    assert engine.kv_cache_manager.prefix_cache_stats.hits >= 3 * 40 - 3 * 8
