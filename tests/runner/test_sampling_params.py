"""`SamplingParams`: vLLM's fields and defaults, and one clear error per bad value."""

import pytest

from unified_attn import SamplingParams


def test_defaults_keep_the_engine_greedy_with_no_filter_or_penalty():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.min_tokens, p.temperature, p.top_k, p.top_p) == (
        1,
        16,
        0,
        0.0,
        0,
        1.0,
    )
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.stop, p.stop_token_ids, p.logprobs, p.seed) == ((), (), None, None)
    assert p.greedy and not p.has_penalties


def test_vllm_spellings_are_accepted_as_they_are():
    p = SamplingParams(top_k=-1, max_tokens=None, stop="\n", stop_token_ids=[5, 6])
    assert p.top_k == -1 and p.max_tokens is None  # -1 and None are kept, not rewritten
    assert p.stop == ("\n",) and p.stop_token_ids == (5, 6)  # one string or a list: a tuple
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(repetition_penalty=1.2).has_penalties


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("n", 0, "n must be a positive int, got 0"),
        ("n", 1.0, "n must be a positive int, got 1.0"),
        ("max_tokens", 0, "max_tokens must be a positive int or None, got 0"),
        ("min_tokens", -1, "min_tokens must be an int >= 0, got -1"),
        ("temperature", -0.1, "temperature must be a number >= 0, got -0.1"),
        ("top_k", -2, r"top_k must be an int >= 1, or 0 or -1 for no top-k filter, got -2"),
        ("top_k", 2.5, "top_k must be an int"),
        ("top_p", 0.0, r"top_p must be a number in \(0, 1\]"),
        ("top_p", "0.9", r"top_p must be a number in \(0, 1\] .*got '0.9'"),
        ("presence_penalty", 2.5, r"presence_penalty must be a number in \[-2, 2\], got 2.5"),
        ("frequency_penalty", -3, r"frequency_penalty must be a number in \[-2, 2\], got -3"),
        ("repetition_penalty", 0.0, "repetition_penalty must be a positive number, got 0.0"),
        ("seed", 1.5, r"seed must be None or an int in \[0, 9223372036854775807\], got 1.5"),
        ("seed", -1, "seed must be None or an int in"),
        ("temperature", float("inf"), "temperature must be a finite number, got inf"),
        ("min_p", 1.5, r"min_p must be a number in \[0, 1\], got 1.5"),
        ("logit_bias", {3: 500.0}, r"logit_bias must be a bias in \[-100, 100\] for token 3"),
        ("allowed_token_ids", [], "allowed_token_ids must be None or a non-empty list"),
        ("prompt_logprobs", -2, "prompt_logprobs must be None, an int >= 0, or -1"),
        ("output_kind", "delta", "output_kind must be a RequestOutputKind"),
        ("stop", [""], "stop must be a non-empty string or a list of non-empty strings"),
        ("stop", 3, "stop must be a non-empty string or a list"),
        ("stop", [".", 3], "stop must be"),
        ("stop_token_ids", "abc", r"stop_token_ids must be a list of token ids \(ints >= 0\)"),
        ("stop_token_ids", [1, -1], "stop_token_ids must be a list of token ids"),
        ("stop_token_ids", [True], "stop_token_ids must be a list of token ids"),
        ("ignore_eos", 1, "ignore_eos must be True or False, got 1"),
        ("logprobs", -1, "logprobs must be an int >= 0, got -1"),
        ("prompt_logits", "yes", "prompt_logits must be True or False"),
        ("return_logits", None, "return_logits must be True or False"),
    ],
)
def test_a_bad_value_names_the_field_what_it_must_be_and_what_it_got(field, value, message):
    with pytest.raises(ValueError, match=f"SamplingParams.{message}"):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_refused_with_both_values():
    with pytest.raises(ValueError, match="min_tokens=5 and max_tokens=3; lower min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=3)
    assert SamplingParams(min_tokens=50, max_tokens=None).min_tokens == 50


def test_fields_are_keywords_only():
    with pytest.raises(TypeError):
        SamplingParams(16)  # type: ignore[misc]
