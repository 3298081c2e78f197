"""BERT through the engine: `encode()` returns transformers' last hidden states for a batch of
mixed lengths, and the worker allocates no KV cache for it."""

from __future__ import annotations

import pytest
import torch

from tests.models.hf_encoder_models import make_hf_bert, save_hf_model
from unified_attn import LLMEngine, SamplingParams

PROMPTS = [[5, 6, 7], [9], list(range(10, 40)), [3, 4, 5, 6, 7, 8, 9]]


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    hf = make_hf_bert(seed=1)
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("bert"))


def make_engine(path, **overrides):
    options = dict(backend="reference", device="cpu", dtype="float32")
    return LLMEngine(str(path), **{**options, **overrides})


def hf_hidden(hf, ids):
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).last_hidden_state[0]


@pytest.mark.parametrize("budget", [64, 8], ids=["one forward", "a forward per budget"])
def test_encode_matches_transformers(bert, budget):
    hf, path = bert
    engine = make_engine(path, max_num_batched_tokens=budget)
    outputs = engine.encode(PROMPTS)
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.hidden_states.shape == (len(prompt), hf.config.hidden_size)
        assert (out.hidden_states - hf_hidden(hf, prompt)).abs().max() < 1e-4
    # a single prompt (not a list) gives a list of one
    assert len(engine.encode(PROMPTS[0])) == 1


def test_no_kv_cache_is_allocated(bert):
    engine = make_engine(bert[1])
    report = engine.kv_cache_report
    assert report.groups == () and report.bytes_per_block == 0 and report.total_bytes == 0
    assert engine.worker.kv_buffer is not None and engine.worker.kv_buffer.numel() == 0


def test_encoder_only_models_refuse_generate_and_bad_prompts(bert):
    engine = make_engine(bert[1])
    with pytest.raises(ValueError, match="encoder-only model, it generates no tokens; use encode"):
        engine.generate([[1, 2]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="encode: prompt 1: the prompt is empty"):
        engine.encode([[1], []])
    with pytest.raises(ValueError, match="the prompt has 65 tokens, more than max_model_len=64"):
        engine.encode([[1] * 65])
    with pytest.raises(ValueError, match="has no encoder input"):
        engine.encode([{"encoder_prompt_token_ids": [1]}])
    assert not engine.has_unfinished_requests()
