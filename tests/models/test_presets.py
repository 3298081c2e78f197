"""Presets: lookup, errors, their families' layer patterns, and a paged prefill/decode of each."""

import pytest
import torch

from tests.models.prefill import PagedRunner, prefill_logits
from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.models import PRESETS, ByteTokenizer, DecoderModel, LayerKind, get_preset


def test_tiny_llama_shape():
    cfg = get_preset("tiny-llama")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.head_size) == (384, 128, 4, 32)
    assert cfg.tie_word_embeddings


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown model preset 'nope'.*tiny-hybrid, tiny-llama"):
        get_preset("nope")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_byte_tokenizer_ids_fit(name):
    cfg, tok = get_preset(name), ByteTokenizer()
    assert tok.bos_token_id == cfg.bos_token_id and tok.eos_token_ids == cfg.eos_token_ids
    assert max(tok.encode("\xff" * 3, add_bos=True)) < cfg.vocab_size


SLIDING_SINKS, FULL_SINKS = LayerKind.sliding(128, has_sinks=True), LayerKind.full(has_sinks=True)
PATTERNS = {
    "mistral-like": (LayerKind.sliding(64),) * 4,
    "gemma2-like": (LayerKind.sliding(64), LayerKind.full()) * 2,
    "gpt-oss-like": (SLIDING_SINKS, FULL_SINKS) * 2,
    "llama4-like": (*(LayerKind.chunked(64),) * 3, LayerKind.full()),
}


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_family_layer_patterns(name):
    cfg = get_preset(name)
    assert cfg.layer_kinds == PATTERNS[name]
    if name == "gemma2-like":
        assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (50.0, 30.0)
        assert (cfg.norm_style, cfg.mlp_kind, cfg.post_norms) == ("gemma", "geglu", True)
    if name == "gpt-oss-like":
        assert cfg.moe is not None and (cfg.moe.num_experts, cfg.moe.top_k) == (4, 2)
        assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "yarn"


def make_model(name: str) -> DecoderModel:
    model = DecoderModel(get_preset(name), ReferenceAttentionBackend)
    model.init_random_weights(0)
    return model


def prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


# PagedRunner lays out paged K/V only; presets with state layers run through the engine in
# tests/runner/test_presets_engine.py.
ATTENTION_ONLY = sorted(
    n for n, c in PRESETS.items() if all(k.kind != "linear_state" for k in c.layer_kinds)
)


@pytest.mark.parametrize("name", ATTENTION_ONLY)
def test_batched_prefill_runs_and_equals_single_prefills(name):
    # 150 tokens cross every window (64, 128) and chunk (64) of the presets.
    model = make_model(name)
    batch = prompts([150, 3, 1, 41])
    together = prefill_logits(model, batch, block_size=16)
    for prompt, logits in zip(batch, together, strict=True):
        assert logits.shape == (len(prompt), 384) and torch.isfinite(logits).all()
        torch.testing.assert_close(logits, prefill_logits(model, [prompt])[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_cached_steps_equal_one_prefill(name):
    model = make_model(name)
    full = prompts([160], seed=1)[0]
    expected = prefill_logits(model, [full], block_size=16)[0]
    runner = PagedRunner(model, num_reqs=1, max_len=len(full), block_size=16)
    got = [runner.step([full[:100]])]
    got += [runner.step([full[pos : pos + 1]]) for pos in range(100, 110)]  # decode steps
    got.append(runner.step([full[110:]]))
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-5, rtol=0)
