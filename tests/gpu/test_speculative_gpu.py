"""Speculative decoding on CUDA: decode steps that verify drafts replay captured graphs (one
per batch size and `1 + k` tokens per request) and give what eager steps give."""

from __future__ import annotations

import pytest
import torch

from unified_attn import LLMEngine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SPEC = dict(speculative_method="ngram", num_speculative_tokens=3)
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
