"""BART through the engine: decoder logits and greedy tokens equal transformers' with mixed
encoder lengths, chunked decoder prefill, decoder prefix hits and preemption."""

from __future__ import annotations

import pytest
import torch

from tests.models.hf_encoder_models import make_hf_bart, save_hf_model
from unified_attn import LLMEngine, SamplingParams

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    hf = make_hf_bart(seed=3)
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("bart"))


def hf_greedy(hf, encoder_ids, decoder_ids, steps):
    """transformers' greedy tokens and the logits of each generated position."""
    enc = torch.tensor([encoder_ids])
    dec = list(decoder_ids)
    logits = []
    with torch.no_grad():
        for _ in range(steps):
            row = hf(input_ids=enc, decoder_input_ids=torch.tensor([dec])).logits[0, -1]
            logits.append(row)
            dec.append(int(row.argmax()))
    return dec[len(decoder_ids) :], torch.stack(logits)


def make_engine(path, **overrides):
    options = dict(
        backend="reference",
        device="cpu",
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=8,
        kv_cache_memory="256KiB",
    )
    return LLMEngine(str(path), **{**options, **overrides})


PROMPTS = [
    {"encoder_prompt_token_ids": [0, *range(5, 22), 2], "prompt_token_ids": [2, 0, 7, 9, 11, 4]},
    {"encoder_prompt_token_ids": [0, 40, 41, 2], "prompt_token_ids": [2]},
    {"encoder_prompt_token_ids": [0, *range(60, 90), 2], "prompt_token_ids": [2, 0, 33]},
    # the first request's decoder prompt with another encoder input: no decoder prefix hit
    {"encoder_prompt_token_ids": [0, 50, 51, 52, 2], "prompt_token_ids": [2, 0, 7, 9, 11, 4]},
    # the first request again: a decoder prefix hit
    {"encoder_prompt_token_ids": [0, *range(5, 22), 2], "prompt_token_ids": [2, 0, 7, 9, 11, 4]},
]


def check_against_hf(hf, outputs, prompts):
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens, logits = hf_greedy(
            hf, prompt["encoder_prompt_token_ids"], prompt["prompt_token_ids"], MAX_TOKENS
        )
        assert out.output_token_ids == tokens
        assert (out.logits - logits).abs().max() < 1e-4
        assert out.encoder_prompt_token_ids == prompt["encoder_prompt_token_ids"]


def test_bart_matches_transformers_with_chunked_prefill_and_prefix_hits(bart):
    hf, path = bart
    engine = make_engine(path)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                            return_logits=True)  # fmt: skip
    outputs = engine.generate(PROMPTS, params)
    check_against_hf(hf, outputs, PROMPTS)
    # one group for the decoder's self-attention, one for cross-attention
    managers = [g["manager"] for g in engine.kv_cache_report.groups]
    assert sorted(managers) == ["CrossAttentionManager", "FullAttentionManager"]
    # the repeated request hit its decoder prefix; the cross group takes no hits
    stats = {s["manager"]: s["hit_blocks"] for s in engine.kv_cache_manager.group_stats()}
    assert stats["FullAttentionManager"] > 0 and stats["CrossAttentionManager"] == 0
    assert engine.kv_cache_manager.usage == 0


def test_bart_matches_transformers_under_preemption(bart):
    hf, path = bart
    # 4 KiB per block: 33 blocks, one request of max_model_len (16 + 16 blocks) and the null block
    engine = make_engine(path, kv_cache_memory="135KiB")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                            return_logits=True)  # fmt: skip
    outputs = engine.generate(PROMPTS, params)
    assert sum(o.num_preemptions for o in outputs) > 0
    check_against_hf(hf, outputs, PROMPTS)


def test_bart_overlapped_steps_give_transformers_tokens_under_preemption(bart):
    """Overlapped steps (async scheduling): a decoder step is scheduled before the previous
    step's token reaches the host, the encoder pass of admitted requests included."""
    hf, path = bart
    engine = make_engine(path, kv_cache_memory="135KiB", async_scheduling=True)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(PROMPTS, params)
    assert sum(o.num_preemptions for o in outputs) > 0
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        tokens, _ = hf_greedy(
            hf, prompt["encoder_prompt_token_ids"], prompt["prompt_token_ids"], MAX_TOKENS
        )
        assert out.output_token_ids == tokens
    assert engine.kv_cache_manager.usage == 0


def test_a_plain_prompt_is_the_encoder_input(bart):
    hf, path = bart
    engine = make_engine(path)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = engine.generate([[0, 8, 9, 10, 2]], params)[0]
    tokens, _ = hf_greedy(hf, [0, 8, 9, 10, 2], [hf.config.decoder_start_token_id], 4)
    assert out.output_token_ids == tokens
    assert out.prompt_token_ids == [hf.config.decoder_start_token_id]


@pytest.mark.parametrize(
    "prompt, message",
    [
        ({"encoder_prompt_token_ids": []}, "the encoder prompt is empty"),
        ({"encoder_prompt_token_ids": [1] * 65}, "more than the model's max_encoder_len=64"),
        ({"encoder_prompt_token_ids": [1, 500]}, "token id 500 is outside .* encoder prompt"),
        ({"encoder_prompt_token_ids": [1], "prompt_token_ids": []}, "the prompt is empty"),
        ({"encoder_prompt_token_ids": [1], "extra": 1}, r"unknown prompt keys \['extra'\]"),
        ({"encoder_prompt": [1]}, "'encoder_prompt' must be text"),
    ],
)
def test_bad_encoder_decoder_prompts_are_refused(bart, prompt, message):
    engine = make_engine(bart[1])
    with pytest.raises(ValueError, match=message):
        engine.add_request(None, prompt)
    assert not engine.has_unfinished_requests()
