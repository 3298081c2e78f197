"""Speculative decoding on CUDA: decode steps that verify drafts replay captured graphs (one
per batch size and `1 + k` tokens per request) and give what eager steps give."""

from __future__ import annotations

import pytest
import torch

from unified_attn import LLMEngine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SPEC = dict(speculative_method="ngram", num_speculative_tokens=3, kv_cache_memory="256MiB")
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 6, [3, 4] * 20, list(range(30, 90))]


@pytest.mark.parametrize("preset", ["tiny-llama", "gemma2-like", "streaming-llm"])
def test_verification_steps_replay_graphs_and_match_eager_steps(preset):
    params = SamplingParams(max_tokens=40, ignore_eos=True, return_logits=True)
    eager = LLMEngine(preset, device="cuda", cuda_graphs=False, **SPEC)
    want = eager.generate(PROMPTS, params)
    engine = LLMEngine(preset, device="cuda", **SPEC)
    got = engine.generate(PROMPTS, params)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.query_lens == (1, 4)
    assert graphs.num_replays > 0 and engine.stats.spec_accepted > 0
    for a, b in zip(got, want, strict=True):
        assert a.output_token_ids == b.output_token_ids
        assert torch.equal(a.logits, b.logits)


@pytest.mark.parametrize("draft", ["tiny-llama", "mistral-like"])
def test_a_draft_model_replays_its_decode_graphs_and_matches_eager_steps(draft):
    """The draft's one-token forwards replay its own captured graphs; target and draft graphs
    give the eager run's tokens and logits (bf16), and self-drafting is accepted."""
    # max_model_len under 1024: no split-KV plan in the one-token graphs either, so replay must
    # equal eager bit for bit. (A random draft is never accepted: every request's last step is
    # a one-token decode step, which a graph planned for 2048 tokens would run split-KV while
    # the eager step of ~100-token sequences does not; docs/architecture.md.)
    options = dict(speculative_method="draft", draft_model=draft, num_speculative_tokens=3,
                   max_model_len=512, kv_cache_memory="256MiB")  # fmt: skip
    params = SamplingParams(max_tokens=40, ignore_eos=True, return_logits=True)
    eager = LLMEngine("tiny-llama", device="cuda", cuda_graphs=False, **options)
    want = eager.generate(PROMPTS, params)
    engine = LLMEngine("tiny-llama", device="cuda", **options)
    got = engine.generate(PROMPTS, params)
    drafter_graphs = engine.drafter.runner.graphs
    assert drafter_graphs is not None and drafter_graphs.num_replays > 0
    assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0
    for a, b in zip(got, want, strict=True):
        assert a.output_token_ids == b.output_token_ids
        assert torch.equal(a.logits, b.logits)
    if draft == "tiny-llama":
        assert engine.stats.spec_acceptance_rate > 0.8


def test_a_draft_model_keeps_greedy_tokens_in_float32():
    options = dict(device="cuda", dtype="float32", kv_cache_memory="256MiB")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = LLMEngine("tiny-llama", **options).generate(PROMPTS, params)
    engine = LLMEngine("tiny-llama", speculative_method="draft", draft_model="gemma2-like",
                       num_speculative_tokens=4, **options)  # fmt: skip
    got = engine.generate(PROMPTS, params)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in plain]
    assert engine.stats.spec_drafted > 0 and engine.drafter.kv_cache_manager.usage == 0.0
