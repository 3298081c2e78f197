"""Byte tokenizer round trips; the transformers wrapper over a locally built tokenizer."""

import pytest

from unified_attn.models import ByteTokenizer, HFTokenizer
from unified_attn.models.tokenizer import load_tokenizer


def test_byte_round_trip_and_specials():
    tok = ByteTokenizer()
    ids = tok.encode("héllo ✓", add_bos=True)
    assert ids[0] == 256 and all(0 <= i < 256 for i in ids[1:])
    assert tok.decode([*ids, 257]) == "héllo ✓"


def test_byte_decode_replaces_broken_utf8():
    assert ByteTokenizer().decode([0x68, 0xC3]) == "h\ufffd"


def test_byte_rejects_special_ids_inside_byte_range():
    with pytest.raises(ValueError, match=">= 256"):
        ByteTokenizer(bos_token_id=1)


def save_word_tokenizer(path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "world": 4}
    model = tokenizers.models.WordLevel(vocab, unk_token="<unk>")
    raw = tokenizers.Tokenizer(model)
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    raw.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(path)


def test_hf_wrapper(tmp_path):
    save_word_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello world", add_bos=True) == [0, 3, 4]
    assert tok.decode([0, 3, 4, 1]) == "hello world"
    assert tok.eos_token_ids == (1,)


def test_no_tokenizer_files(tmp_path):
    assert load_tokenizer(tmp_path) is None
