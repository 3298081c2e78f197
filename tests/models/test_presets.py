"""Presets: lookup, errors, and that the byte tokenizer's ids fit their vocabularies."""

import pytest

from unified_attn.models import PRESETS, ByteTokenizer, get_preset


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
