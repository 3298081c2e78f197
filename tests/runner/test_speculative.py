"""Speculative decoding with the n-gram drafter: the drafter, rejection sampling (it keeps the
target distribution), the engine's refusals, and outputs equal to decoding without drafts."""

from __future__ import annotations

import pytest
import torch

from unified_attn import LLMEngine, SamplingParams
from unified_attn.request import Request
from unified_attn.runner.sampler import Sampler
from unified_attn.spec_decode.proposers import NgramProposer

SPEC = dict(speculative_method="ngram", num_speculative_tokens=4)


# ---- the drafter --------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_earlier_match():
    proposer = NgramProposer(3)
    assert proposer.propose([1, 2, 3, 4, 1, 2]) == [3, 4, 1]
    assert proposer.propose([1, 2, 3, 4, 1, 2], max_tokens=2) == [3, 4]
    assert proposer.propose([1, 2, 3]) == [3, 3, 3]  # nothing recurs: the last token again
    assert proposer.propose([1, 2, 3, 4, 9, 2, 3]) == [4, 9, 2]
    assert proposer.propose([4, 1, 2, 3, 1, 2]) == [3, 1, 2]
    assert proposer.propose([8, 1, 2, 9, 1, 2]) == [9, 1, 2]
    # the longest suffix wins: [8, 1, 2] occurred later than another [1, 2]
    assert proposer.propose([1, 2, 5, 8, 1, 2, 6, 8, 1, 2]) == [6, 8, 1]
    assert proposer.propose([7, 7, 7], max_tokens=0) == []
    # in a repeating run, the latest match with a full continuation, not the one that ends
    # right before the suffix (it would propose one token); a short find is padded
    assert proposer.propose([7] * 10) == [7, 7, 7]
    assert proposer.propose([5, 6, 5]) == [6, 5, 5]


def test_ngram_settings_are_checked():
    with pytest.raises(ValueError, match="prompt_lookup_min=5 is more than prompt_lookup_max=2"):
        NgramProposer(3, prompt_lookup_min=5, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(0)


# ---- verification -------------------------------------------------------------------------------


def test_rejection_sampling_keeps_the_target_distribution():
    """Chi-square over 20000 verifications of a draft with a target of 6 tokens: the first
    token is distributed as the target whatever the draft."""
    target = torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])
    logits = torch.log(target)[None].repeat(2, 1)
    sampler = Sampler(torch.device("cpu"), seed=0)
    params = SamplingParams(temperature=1.0, seed=3)
    request = Request("r", [1], sampling_params=params)
    counts = torch.zeros(6)
    trials = 20000
    for _ in range(trials):
        tokens, _ = sampler.verify(logits, request, [4])  # a draft the target rarely picks
        counts[tokens[0]] += 1
    expected = target * trials
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # the 0.999 quantile of chi-square with 5 degrees of freedom


def test_greedy_verification_accepts_the_argmax_prefix_and_adds_one():
    sampler = Sampler(torch.device("cpu"))
    request = Request("r", [1], sampling_params=SamplingParams(temperature=0.0))
    logits = torch.full((4, 10), -5.0)
    for row, best in enumerate([3, 4, 8, 2]):
        logits[row, best] = 5.0
    assert sampler.verify(logits, request, [3, 4, 5])[0] == [3, 4, 8]  # third draft rejected
    assert sampler.verify(logits, request, [3, 4, 8])[0] == [3, 4, 8, 2]  # all + a bonus


def test_penalties_see_the_accepted_drafts():
    """Row j is penalized as if the drafts before it were output: a frequency penalty that
    flips the argmax once token 3 has been output rejects a second 3."""
    sampler = Sampler(torch.device("cpu"))
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    request = Request("r", [1], sampling_params=params)
    logits = torch.zeros(3, 10)
    logits[:, 3], logits[:, 4] = 1.5, 1.0
    assert sampler.verify(logits, request, [3, 3])[0] == [3, 4]


# ---- the engine ---------------------------------------------------------------------------------

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 6, list(range(40, 80)), [3, 4, 3, 4, 3, 4] * 5]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-hybrid", "streaming-llm"])
def test_outputs_equal_decoding_without_drafts(preset):
    params = [
        SamplingParams(max_tokens=20, ignore_eos=True, logprobs=2, return_logits=True),
        SamplingParams(max_tokens=7, ignore_eos=True, min_tokens=3, presence_penalty=0.5),
        SamplingParams(max_tokens=30, ignore_eos=True, repetition_penalty=1.2),
    ]
    plain = LLMEngine(preset).generate(PROMPTS, params)
    engine = LLMEngine(preset, **SPEC)
    spec = engine.generate(PROMPTS, params)
    assert engine.stats.spec_accepted > 0 and engine.stats.steps < 30
    for a, b in zip(plain, spec, strict=True):
        assert a.output_token_ids == b.output_token_ids
        assert (a.finish_reason, b.finish_reason) == ("length", "length")
    assert torch.allclose(plain[0].logits, spec[0].logits, atol=1e-5)
    for x, y in zip(plain[0].outputs[0].logprobs, spec[0].outputs[0].logprobs, strict=True):
        assert x.keys() == y.keys()
        assert all(abs(x[t].logprob - y[t].logprob) < 1e-5 for t in x)


def test_a_stop_token_among_accepted_drafts_ends_the_request_there():
    plain = LLMEngine("tiny-llama").generate(PROMPTS[:1], SamplingParams(max_tokens=30))
    stop = plain[0].output_token_ids[5]
    params = SamplingParams(max_tokens=30, stop_token_ids=[stop], ignore_eos=True)
    want = LLMEngine("tiny-llama").generate(PROMPTS[:1], params)[0]
    engine = LLMEngine("tiny-llama", **SPEC)
    got = engine.generate(PROMPTS[:1], params)[0]
    assert got.output_token_ids == want.output_token_ids
    assert got.output_token_ids[-1] == stop and got.outputs[0].stop_reason == stop
    assert engine.kv_cache_manager.usage == 0


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(speculative_method="eagle", num_speculative_tokens=3), "methods are ngram, draft"),
        (dict(speculative_method="ngram"), "needs num_speculative_tokens, a positive int"),
        (dict(num_speculative_tokens=3), "needs speculative_method"),
        (dict(model="hybrid-linear", mamba_cache_mode="align", **SPEC),
         "over state layers .* needs mamba_cache_mode='none', got 'align'"),
    ],
)
def test_settings_and_models_speculation_cannot_serve_are_refused(options, message):
    model = options.pop("model", "tiny-llama")
    with pytest.raises(ValueError, match=message):
        LLMEngine(model, **options)


def test_the_run_command_reports_drafts_and_acceptance(capsys):
    import json

    from unified_attn.cli import main

    argv = ["run", "--num-requests", "4", "--max-tokens", "16", "--json",
            "--speculative-method", "ngram", "--num-speculative-tokens", "3"]  # fmt: skip
    assert main(argv) == 0
    spec = json.loads(capsys.readouterr().out)["speculative"]
    assert spec["method"] == "ngram" and 0 < spec["accepted"] <= spec["drafted"]
    assert 0 < spec["acceptance_rate"] <= 1 and spec["mean_accepted_per_step"] > 0
