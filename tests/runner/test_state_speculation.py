"""Speculative decoding over state layers (Mamba-2, gated delta-net) against transformers: a
verify step leaves the state after each of its tokens in the request's state slots
(`num_speculative_blocks`), and the next step resumes from the slot of the last kept token. An
oracle proposer drafts transformers' own greedy continuation with every other step's second
draft wrong, so steps accept all drafts, some, or none; n-gram drafts run too."""

import pytest

from tests.models.hf_models import hf_greedy, make_family_model, save_hf_model
from tests.runner.test_engine_hf_parity import NUM_TOKENS, PARAMS, check_against_hf, prompts
from unified_attn import LLMEngine

MEMORY = "2MiB"
K = 3


class OracleProposer:
    """Drafts the known continuation of each prompt, the second draft of every other step
    wrong."""

    num_speculative_tokens = K

    def __init__(self, continuations, vocab_size):
        self.continuations, self.vocab_size = continuations, vocab_size
        self.calls = 0

    def draft(self, requests):
        for request, limit in requests:
            done, limit = len(request.output_token_ids), min(limit, K)
            drafts = list(self.continuations[tuple(request.prompt_token_ids)][done : done + limit])
            self.calls += 1
            if self.calls % 2 and len(drafts) > 1:
                drafts[1] = (drafts[1] + 1) % self.vocab_size
            request.spec_token_ids = drafts


@pytest.fixture(scope="module", params=["nemotron-h", "mamba2", "qwen3-next", "granite-4.0-h"])
def checkpoint(request, tmp_path_factory):
    hf = make_family_model(request.param)
    return hf, save_hf_model(hf, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("budget", [48, 16])  # one prefill step, or chunks and preemption
def test_rolled_back_drafts_resume_from_the_kept_state(checkpoint, budget):
    hf, path = checkpoint
    batch = prompts([23, 5, 40], seed=3)
    probe = LLMEngine(str(path), kv_cache_memory=MEMORY, max_model_len=80,
                      max_num_batched_tokens=budget, speculative_method="ngram",
                      num_speculative_tokens=K)  # fmt: skip
    memory = MEMORY
    if budget == 16:  # two requests start, and cannot both grow to max_model_len
        memory = probe.worker.plan.bytes_per_block * (2 * sum(probe.worker.blocks_per_request) - 2)
    engine = LLMEngine(str(path), kv_cache_memory=memory, max_model_len=80,
                       max_num_batched_tokens=budget, speculative_method="ngram",
                       num_speculative_tokens=K)  # fmt: skip
    continuations = {tuple(p): hf_greedy(hf, p, NUM_TOKENS + K) for p in batch}
    engine.drafter = OracleProposer(continuations, hf.config.vocab_size)
    outputs = engine.generate(batch, PARAMS)
    check_against_hf(hf, outputs, batch, prompt_logits=False)
    assert 0.3 < engine.stats.spec_acceptance_rate < 0.95  # full, partial and no acceptance
    grows = any("State" not in g.manager_cls.__name__ for g in engine.worker.plan.groups)
    if budget == 16 and grows:  # (a model of state layers alone never outgrows its blocks)
        assert engine.scheduler.num_preemptions > 0


def test_ngram_speculation_matches_transformers(checkpoint):
    hf, path = checkpoint
    engine = LLMEngine(str(path), kv_cache_memory=MEMORY, max_num_batched_tokens=48,
                       speculative_method="ngram", num_speculative_tokens=4)  # fmt: skip
    pattern = prompts([9], seed=5)[0]
    batch = [pattern * 4, prompts([30], seed=6)[0]]
    check_against_hf(hf, engine.generate(batch, PARAMS), batch, prompt_logits=False)
    assert engine.stats.spec_drafted > 0
    groups = engine.worker.plan.groups
    assert all(g.config.num_speculative_blocks == 4 for g in groups if "State" in
               g.manager_cls.__name__)  # fmt: skip
