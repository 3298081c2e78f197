"""Mamba-2 hybrids (Mamba2, Bamba, Nemotron-H with and without MoE blocks, Granite-4.0-H) on
the GPU (run through the device tool): the Triton state kernels in eager prefill (varlen
convolution and chunked scan, with "all" mode's checkpoints) and in decode steps replayed from
CUDA graphs give transformers' greedy tokens and logits in float32, with prefix hits in every
cache mode."""

from __future__ import annotations

import pytest
import torch

from tests.models.hf_models import hf_greedy, hf_logits, make_family_model, save_hf_model
from unified_attn import LLMEngine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Scan chunks of 16 (the kernel takes powers of two >= 16; the CPU tests use 8), and one group
# of B and C: transformers 5.17 (the GPU machine's) norms Mamba2's and Bamba's gated output over
# all channels instead of per group, which only agrees with a grouped norm for one group.
CHUNK = {"mamba2": {"chunk_size": 16, "n_groups": 1},
         "bamba": {"mamba_chunk_size": 16, "mamba_n_groups": 1},
         "nemotron-h": {"chunk_size": 16, "n_groups": 1},
         "nemotron-h-moe": {"chunk_size": 16, "n_groups": 1},
         "granite-4.0-h": {"mamba_chunk_size": 16, "mamba_n_groups": 1}}  # fmt: skip
PREFIX = [(7 * j) % 90 + 4 for j in range(64)]
PROMPTS = [[*PREFIX, 5, 6, 7], PREFIX[:32] + [9] * 5, PREFIX[:40] + [3] * 7, [11] * 12]


def check(hf, prompts, outputs):
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.output_token_ids == hf_greedy(hf, prompt, 12)
        want = hf_logits(hf, prompt + out.output_token_ids)[len(prompt) - 1 : -1]
        torch.testing.assert_close(torch.stack(list(out.logits)).float().cpu(), want,
                                   rtol=1e-3, atol=1e-3)  # fmt: skip


@pytest.mark.parametrize("family", sorted(CHUNK))
@pytest.mark.parametrize("mode", ["align", "all", "none"])
def test_state_kernels_give_transformers_tokens_and_logits(family, mode, tmp_path):
    hf = make_family_model(family, **CHUNK[family])
    path = save_hf_model(hf, tmp_path / family)
    engine = LLMEngine(str(path), device="cuda", dtype="float32", max_num_seqs=4,
                       max_model_len=128, kv_cache_memory="64MiB", max_num_batched_tokens=48,
                       mamba_cache_mode=mode)  # fmt: skip
    params = SamplingParams(max_tokens=12, ignore_eos=True, return_logits=True)
    check(hf, PROMPTS[:1], engine.generate(PROMPTS[:1], params))
    outputs = engine.generate(PROMPTS[1:], params)
    check(hf, PROMPTS[1:], outputs)
    assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0
    cached = [o.num_cached_tokens for o in outputs]
    assert (sum(cached) == 0) == (mode == "none"), cached


@pytest.mark.parametrize("family", ["nemotron-h", "granite-4.0-h"])
def test_speculation_over_state_layers_on_the_gpu(family, tmp_path):
    """n-gram drafts over state slots: one-token steps read the kept slot through the Triton
    update kernels, verify steps leave a state per token (decode runs eagerly)."""
    hf = make_family_model(family, **CHUNK[family])
    path = save_hf_model(hf, tmp_path / family)
    engine = LLMEngine(str(path), device="cuda", dtype="float32", max_num_seqs=4,
                       max_model_len=128, kv_cache_memory="64MiB", max_num_batched_tokens=48,
                       speculative_method="ngram", num_speculative_tokens=3)  # fmt: skip
    params = SamplingParams(max_tokens=12, ignore_eos=True, return_logits=True)
    prompts = [PREFIX[:9] * 4, PROMPTS[3]]
    check(hf, prompts, engine.generate(prompts, params))
    assert engine.runner.graphs is None and engine.stats.spec_drafted > 0
