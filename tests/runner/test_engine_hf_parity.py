"""The engine against transformers on saved checkpoints: prompt logits, sampled-position logits
and 32 greedy tokens, for mixed prompt lengths, chunked prefill, prefix-cache hits and
preemption, on every supported family."""

import pytest
import torch

from tests.models.hf_models import hf_logits, make_family_model, make_hf_model, save_hf_model
from tests.models.test_hf import LLAMA3
from unified_attn import LLMEngine, SamplingParams

CASES = {
    "llama": ("llama", dict(num_hidden_layers=2, rope_parameters=LLAMA3)),
    "qwen2": ("qwen2", dict(num_hidden_layers=2)),
    "mistral-window": ("mistral", dict(num_hidden_layers=2, sliding_window=12)),
    "gemma2": ("family", {}),  # window 8, soft caps, Gemma norms
    "gpt-oss": ("family", {}),  # window 8, learned sinks, MoE, YaRN
    "qwen3": ("family", {}),  # q/k norms, window 8 on layer 1
    "phi3-sliding": ("family", {}),  # fused projections, window 8 (without: tests/models)
    "gemma3": ("family", {}),  # local window 8 + global layer, each with its RoPE, q/k norms
    "mixtral": ("family", {}),  # sparse MoE, top-2 of 4
    "qwen2-moe": ("family", {}),  # sparse MoE with a shared expert, then a dense layer
    "qwen3-moe": ("family", {}),  # q/k norms, windows, sparse MoE without a shared expert
    "mamba2": ("family", {}),  # Mamba-2 state layers only: scan chunks of 8
    "bamba": ("family", {}),  # a Mamba-2 layer and an attention layer with partial RoPE
    "nemotron-h": ("family", {}),  # Mamba-2, squared-ReLU MLP and NoPE attention blocks
    # gated delta-net layers, a gated attention layer with partial RoPE, MoE + shared expert
    "qwen3-next": ("family", {}),
    "nemotron-h-moe": ("family", {}),  # + MoE blocks: sigmoid-grouped routing, relu2 experts
    "granite-4.0-h": ("family", {}),  # Mamba + NoPE attention, MoE + shared MLP, multipliers
    "granite-4.0-h-dense-rope": ("family", {}),  # no experts (shared MLP only), RoPE
    # chunked (8) RoPE layers, a NoPE layer with temperature tuning, sigmoid-routed MoE
    "llama4": ("family", {}),
}
# State layers: speculative decoding in tests/runner/test_state_speculation.py (a state slot per
# draft token); a draft model with state layers is refused.
STATE_CASES = {"mamba2", "bamba", "nemotron-h", "qwen3-next", "nemotron-h-moe", "granite-4.0-h",
               "granite-4.0-h-dense-rope"}  # fmt: skip
NUM_TOKENS = 32
# Ample for these tests (a block of the tiny models is a few KiB), and quick to set up: the
# block pool's host bookkeeping grows with the number of blocks.
MEMORY = "2MiB"


def build(name, tmp_path_factory):
    model_type, overrides = CASES[name]
    if model_type == "family":
        hf = make_family_model(name)
    else:
        hf = make_hf_model(model_type, **overrides)
    return hf, save_hf_model(hf, tmp_path_factory.mktemp(name))


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    return build(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=sorted(set(CASES) - STATE_CASES))
def spec_checkpoint(request, tmp_path_factory):
    return build(request.param, tmp_path_factory)


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


PARAMS = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, return_logits=True)
PROMPT_PARAMS = SamplingParams(
    max_tokens=NUM_TOKENS, ignore_eos=True, prompt_logits=True, return_logits=True
)


def test_one_step_prefill_matches_transformers(checkpoint):
    hf, path = checkpoint
    engine = LLMEngine(str(path), max_num_batched_tokens=4096, block_size=8, kv_cache_memory=MEMORY)
    batch = prompts([23, 5, 40, 1, 17])
    check_against_hf(hf, engine.generate(batch, PROMPT_PARAMS), batch, prompt_logits=True)


def test_chunked_prefill_and_preemption_match_transformers(checkpoint):
    # 16-token chunks, and room for one request of max_model_len plus two spare blocks: the
    # requests take turns, preempted and recomputed (from their cached prefix blocks where the
    # layers allow it).
    hf, path = checkpoint
    options = dict(max_model_len=80, max_num_batched_tokens=16, block_size=8)
    probe = LLMEngine(str(path), kv_cache_memory=MEMORY, **options)
    memory = probe.worker.plan.bytes_per_block * (sum(probe.worker.blocks_per_request) + 2)
    engine = LLMEngine(str(path), kv_cache_memory=memory, **options)
    batch = prompts([23, 5, 40, 1, 17])
    check_against_hf(hf, engine.generate(batch, PROMPT_PARAMS), batch, prompt_logits=True)
    assert engine.scheduler.num_preemptions > 0


def test_prefix_cache_hits_match_transformers(checkpoint):
    hf, path = checkpoint
    engine = LLMEngine(str(path), max_num_batched_tokens=64, block_size=8, kv_cache_memory=MEMORY)
    first = prompts([3], seed=1, shared=40)
    check_against_hf(hf, engine.generate(first, PARAMS), first, prompt_logits=False)
    batch = prompts([9, 2, 30], seed=1, shared=40)  # the same 40-token prefix
    check_against_hf(hf, engine.generate(batch, PARAMS), batch, prompt_logits=False)
    assert engine.kv_cache_manager.prefix_cache_stats.hits >= 3 * 40 - 3 * 8


def test_speculative_decoding_matches_transformers(spec_checkpoint):
    """n-gram drafts verified in the decode step: the same greedy tokens and logits."""
    hf, path = spec_checkpoint
    engine = LLMEngine(str(path), kv_cache_memory=MEMORY, max_num_batched_tokens=48,
                       speculative_method="ngram", num_speculative_tokens=4)  # fmt: skip
    pattern = prompts([9], seed=5)[0]
    batch = [pattern * 4, prompts([30], seed=6)[0], [*pattern[:4], 7, 7] * 5]
    outputs = engine.generate(batch, PARAMS)
    check_against_hf(hf, outputs, batch, prompt_logits=False)
    assert engine.stats.spec_drafted > 0


def test_draft_model_speculation_matches_transformers(spec_checkpoint):
    """The checkpoint drafts for itself (the draft path on every family's layers): the same
    greedy tokens and logits as transformers."""
    hf, path = spec_checkpoint
    engine = LLMEngine(str(path), kv_cache_memory=MEMORY, max_num_batched_tokens=48,
                       speculative_method="draft", draft_model=str(path),
                       num_speculative_tokens=3)  # fmt: skip
    batch = [prompts([9], seed=5)[0] * 4, prompts([30], seed=6)[0]]
    outputs = engine.generate(batch, PARAMS)
    check_against_hf(hf, outputs, batch, prompt_logits=False)
    assert engine.stats.spec_acceptance_rate > 0.5


def test_speculation_over_state_layers_needs_mode_none(tmp_path_factory):
    """Speculation over state layers runs in mode "none" (tests/runner/test_state_speculation.py);
    an explicit prefix-caching mode is refused, and so is a draft model with state layers."""
    _, path = build("bamba", tmp_path_factory)
    with pytest.raises(ValueError, match="needs mamba_cache_mode='none', got 'align'"):
        LLMEngine(str(path), kv_cache_memory=MEMORY, speculative_method="ngram",
                  num_speculative_tokens=4, mamba_cache_mode="align")  # fmt: skip
    with pytest.raises(ValueError, match="has state layers"):
        LLMEngine("tiny-llama", kv_cache_memory=MEMORY, speculative_method="draft",
                  draft_model=str(path), num_speculative_tokens=2)  # fmt: skip
