"""Output text and stop rules, as vLLM has them, on known text: the engine's sampler is scripted
(`builders.script`), so every request writes the same bytes through the presets' byte tokenizer.

Stop strings cut the text before them, the token that completed one stays in `token_ids`; stop
tokens and EOS stay out of the text; `min_tokens` delays every stop; streams never show text
that may still turn into a stop string, nor half a character.
"""

import pytest

from tests.runner.builders import script
from unified_attn import LLMEngine, SamplingParams

EOS = 257  # the presets' byte tokenizer: 0..255 are bytes, 256 bos, 257 eos


@pytest.fixture(scope="module")
def engine():
    return LLMEngine("tiny-llama", max_model_len=64)


def run(engine, text, **params):
    script(engine, text)
    params.setdefault("max_tokens", 12)
    (out,) = engine.generate([[1, 2, 3]], SamplingParams(**params))
    return out.outputs[0]


def stream(engine, text, **params):
    script(engine, text)
    params.setdefault("max_tokens", 12)
    return list(engine.stream([[1, 2, 3]], SamplingParams(**params)))


@pytest.mark.parametrize(
    "stop, text, token_text",
    [
        (["."], "Hello world", "Hello world."),
        ([" wor"], "Hello", "Hello wor"),  # across tokens: ends on the token that completes it
        (["ld.", "l"], "He", "Hel"),  # the first one found
    ],
)
def test_stop_strings(engine, stop, text, token_text):
    out = run(engine, "Hello world.", stop=stop)
    assert (out.text, bytes(out.token_ids).decode()) == (text, token_text)
    hit = next(s for s in stop if s in token_text)
    assert (out.finish_reason, out.stop_reason) == ("stop", hit)


def test_of_two_stop_strings_found_by_the_same_token_the_first_listed_wins(engine):
    assert run(engine, "abc", stop=["c", "bc"]).text == "ab"
    assert run(engine, "abc", stop=["bc", "c"]).text == "a"


def test_min_tokens_delays_the_search_for_stop_strings(engine):
    # 'o' at token 5 is not looked for (5 <= min_tokens); the next 'o', at token 8, is
    out = run(engine, "Hello world.", stop=["o"], min_tokens=6)
    assert (out.text, len(out.token_ids), out.stop_reason) == ("Hello w", 8, "o")


def test_a_stop_token_ends_the_output_and_stays_out_of_the_text(engine):
    out = run(engine, "Hello world.", stop_token_ids=[ord(" ")])
    assert (out.text, bytes(out.token_ids)) == ("Hello", b"Hello ")
    assert (out.finish_reason, out.stop_reason) == ("stop", ord(" "))


def test_eos_stays_out_of_the_text_and_has_no_stop_reason(engine):
    out = run(engine, [*b"ab", EOS, *b"cd"])
    assert (out.text, out.token_ids, out.finish_reason, out.stop_reason) == (
        "ab",
        [97, 98, EOS],
        "stop",
        None,
    )


def test_eos_ends_the_output_whatever_min_tokens_as_vllms_check_stop(engine):
    """The sampler masks EOS until `min_tokens` (tests/runner/test_sampler.py); a scripted one
    that gets through still stops, as vLLM 0.33's `check_stop` does not look at min_tokens."""
    out = run(engine, [*b"a", EOS, *b"bcdef"], min_tokens=3, max_tokens=5)
    assert (out.token_ids, out.text, out.finish_reason) == ([97, EOS], "a", "stop")


def test_eos_as_the_last_allowed_token_is_a_stop_not_a_length(engine):
    out = run(engine, [*b"ab", EOS], max_tokens=3)
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([97, 98, EOS], "stop", None)


def test_a_stop_string_on_the_last_allowed_token_is_a_stop_not_a_length(engine):
    out = run(engine, "Hello.", stop=["."], max_tokens=6)
    assert (out.text, out.finish_reason, out.stop_reason) == ("Hello", "stop", ".")


def test_text_is_whole_characters_and_an_unfinished_one_shows_at_the_end(engine):
    word = "héllo wörld".encode()
    assert run(engine, word, stop=["ö"]).text == "héllo w"
    assert run(engine, b"ab\xc3", max_tokens=3).text == "ab\ufffd"  # as the tokenizer decodes
    deltas = stream(engine, word, max_tokens=len(word))
    assert "".join(d.text for d in deltas) == "héllo wörld"
    assert all("\ufffd" not in d.text for d in deltas)
    assert [d.text for d in stream(engine, b"ab\xc3", max_tokens=3)] == ["a", "b", "\ufffd"]


def test_a_stream_holds_back_text_that_may_become_a_stop_string(engine):
    deltas = stream(engine, "abxyzcd", stop=["xyz"])
    assert [d.text for d in deltas] == ["", "", "a", "b", ""]
    assert b"".join(bytes(d.token_ids) for d in deltas) == b"abxyz"
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", "xyz")
    # without a stop string nothing is held back
    assert [d.text for d in stream(engine, "abc", max_tokens=3)] == ["a", "b", "c"]


def test_max_tokens_none_runs_to_max_model_len(engine):
    out = run(engine, "x" * 64, max_tokens=None)
    assert (len(out.token_ids), out.finish_reason) == (64 - 3, "length")


def test_without_a_tokenizer_text_is_none_and_stop_strings_are_refused(engine, monkeypatch):
    monkeypatch.setattr(engine, "tokenizer", None)
    with pytest.raises(ValueError, match=r"stop=\['x'\] needs a tokenizer .* use stop_token_ids"):
        engine.add_request(None, [1, 2], SamplingParams(stop="x"))
    with pytest.raises(ValueError, match="no tokenizer: pass token ids"):
        engine.add_request(None, "text")
    assert not engine.has_unfinished_requests()
    script(engine, "abc")
    out = engine.generate([[1, 2]], SamplingParams(max_tokens=3, logprobs=1))[0]
    assert out.text is None and out.outputs[0].text is None
