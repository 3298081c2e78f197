"""Incremental detokenization (`engine/detokenizer.py`): a fast tokenizer's one-token stream
(`HFTokenizer.decode_stream`, the `tokenizers` library's `DecodeStream`) gives the text, the
streamed deltas and the stop strings of the window decode, token by token and at the end, for
byte-level BPE (pieces of UTF-8 characters), SentencePiece-style and word-level tokenizers, with
special tokens skipped or spelled; a stream that fails hands over to the windows."""

from __future__ import annotations

import random

import pytest

from tests.models.test_tokenizer import save_word_tokenizer
from unified_attn import SamplingParams
from unified_attn.engine.detokenizer import IncrementalText
from unified_attn.models.tokenizer import HFTokenizer, load_tokenizer

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Ünïcödé: naïve café, 日本語のテキスト, "
    "emoji 🙂🚀 and math ∑ ∫ √.",
    "Paged attention reads the KV cache block by block; prefix caching shares full blocks.",
    "Ein Käfer überquert die Straße. Приве́т, мир! 你好, 世界。 ¿Qué tal? ça va très bien.",
] * 20


def save_bpe(path, metaspace: bool) -> None:
    """A BPE tokenizer trained on `CORPUS`: byte-level (tokens may end inside a UTF-8
    character) or SentencePiece-style (`▁` for spaces, byte fallback)."""
    pre, dec = tokenizers.pre_tokenizers, tokenizers.decoders
    model = tokenizers.models.BPE(byte_fallback=metaspace, unk_token="<unk>" if metaspace else None)
    raw = tokenizers.Tokenizer(model)
    if metaspace:
        raw.pre_tokenizer = pre.Metaspace()
        raw.decoder = dec.Sequence([dec.ByteFallback(), dec.Metaspace()])
        alphabet = [f"<0x{b:02X}>" for b in range(256)]
    else:
        raw.pre_tokenizer = pre.ByteLevel(add_prefix_space=False)
        raw.decoder = dec.ByteLevel()
        alphabet = pre.ByteLevel.alphabet()
    specials = ["<s>", "</s>", "<unk>"]
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=600, special_tokens=[*specials, *(alphabet if metaspace else [])],
        initial_alphabet=[] if metaspace else alphabet,
    )  # fmt: skip
    raw.train_from_iterator(CORPUS, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(path)


@pytest.fixture(scope="module", params=["byte-level", "sentencepiece", "word-level"])
def tokenizer(request, tmp_path_factory) -> HFTokenizer:
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "word-level":
        save_word_tokenizer(path)
    else:
        save_bpe(path, metaspace=request.param == "sentencepiece")
    loaded = load_tokenizer(path)
    assert loaded is not None
    return loaded


class WindowsOnly:
    """The same tokenizer without `decode_stream`: the window decode."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self.decode = tokenizer.decode


def sequences(tokenizer: HFTokenizer, seed: int) -> list[list[int]]:
    """Encoded text (whole characters) and random ids (specials and UTF-8 pieces among them)."""
    rng = random.Random(seed)
    vocab = len(tokenizer.tokenizer)
    text = tokenizer.encode(rng.choice(CORPUS))[: rng.randrange(5, 60)]
    noise = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
    return [text, noise, text[:7] + noise[:9] + text[7:20]]


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_the_stream_gives_the_windows_text_and_deltas(tokenizer, skip, seed):
    """A token at a time, the two are the same at every step. Several tokens at once (accepted
    drafts) the stream adds the whole characters among them at once, where the window waits
    for the last one to end a character (vLLM decodes them one at a time too): the window's
    text is a prefix of the stream's, the same once final."""
    params = SamplingParams(skip_special_tokens=skip, stop=["ab", "é", "\ufffd"], min_tokens=2)
    rng = random.Random(seed)
    for ids in sequences(tokenizer, seed):
        for chunks in (False, True):
            fast = IncrementalText(tokenizer, params)
            slow = IncrementalText(WindowsOnly(tokenizer), params)
            assert fast.stream is not None and slow.stream is None
            done, final, fast_deltas, slow_deltas = 0, False, "", ""
            while not final:
                step = ids[done : done + (rng.randrange(1, 4) if chunks else 1)]
                done += len(step)
                final = done >= len(ids) or rng.random() < 0.05
                for text in (fast, slow):
                    text.add(step, done, final=final)
                fast_deltas += fast.delta(final)
                slow_deltas += slow.delta(final)
                if chunks and not final:
                    assert fast.text.startswith(slow.text), ids[:done]
                else:
                    assert (fast.text, fast.stop_string) == (slow.text, slow.stop_string)
                    assert fast_deltas == slow_deltas


def test_special_tokens_spelled_without_spaces_take_the_windows(tokenizer):
    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)
    assert IncrementalText(tokenizer, params).stream is None
    assert IncrementalText(tokenizer, SamplingParams(spaces_between_special_tokens=False)).stream


def test_a_failing_stream_hands_over_to_the_windows(tokenizer):
    ids = sequences(tokenizer, 0)[2]
    want = IncrementalText(WindowsOnly(tokenizer), SamplingParams())
    got = IncrementalText(tokenizer, SamplingParams())
    fed = []

    def failing(token_id: int) -> str | None:
        fed.append(token_id)
        if len(fed) == 6:
            raise Exception("Invalid prefix encountered")
        return stream(token_id)

    stream, got.stream = got.stream, failing
    for i in range(0, len(ids), 2):
        for text in (got, want):
            text.add(ids[i : i + 2], i + 2, final=i + 2 >= len(ids))
        assert got.text == want.text
    assert got.stream is None and len(fed) == 6
