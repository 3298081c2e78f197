"""vLLM's sampling options beyond penalties: `min_p` (against transformers' `MinPLogitsWarper`),
`logit_bias` (against `SequenceBiasLogitsProcessor`), `allowed_token_ids`, `bad_words`,
`prompt_logprobs` (against the prompt's own logits), `include_stop_str_in_output`,
`skip_special_tokens`, and the outputs' `num_cached_tokens` and `metrics`."""

import math

import pytest
import torch

from tests.runner.builders import script
from unified_attn import LLMEngine, SamplingParams
from unified_attn.engine.detokenizer import IncrementalText
from unified_attn.request import Request
from unified_attn.runner.logits_processing import ban_bad_words
from unified_attn.runner.sampler import Sampler, filter_logits

logits_process = pytest.importorskip("transformers.generation.logits_process")

EOS = 257  # the presets' byte tokenizer


def processed(row, **params):
    """What the sampler's logits processing makes of `row` for a fresh request."""
    request = Request("r", [1, 2], sampling_params=SamplingParams(**params))
    return Sampler(torch.device("cpu"), eos_token_ids=(9,))._process_row(row, request)


@pytest.mark.parametrize("min_p", [0.05, 0.2, 0.6])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_min_p_matches_transformers_after_temperature(min_p, temperature):
    row = torch.randn(64, generator=torch.Generator().manual_seed(7)) * 3
    got = filter_logits(row, SamplingParams(temperature=temperature, min_p=min_p))
    warped = logits_process.MinPLogitsWarper(min_p)(None, (row / temperature)[None])[0]
    assert torch.equal(torch.isinf(got), torch.isinf(warped))
    assert torch.isinf(got).any() and not torch.isinf(got).all()


def test_logit_bias_matches_transformers_sequence_bias():
    row = torch.randn(32, generator=torch.Generator().manual_seed(1))
    bias = {3: 5.0, 7: -100.0, 30: 0.5}
    got = processed(row, logit_bias=bias)
    reference = logits_process.SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
    want = reference(torch.tensor([[1, 2]]), row[None].clone())[0]
    torch.testing.assert_close(got, want)


def test_allowed_token_ids_leave_only_those_tokens():
    row = torch.randn(16)
    got = processed(row, allowed_token_ids=[2, 11])
    assert torch.isfinite(got).nonzero().flatten().tolist() == [2, 11]
    assert torch.equal(got[[2, 11]], row[[2, 11]])


@pytest.mark.parametrize(
    "output, banned",
    [
        ([], [4]),  # only the one-token word applies
        ([1, 7], [4, 9]),  # ends with 7: the word (7, 9) would be completed by 9
        ([7, 1], [4]),
        ([5, 6], [4, 8]),  # (5, 6, 8): its prefix is the whole output
    ],
)
def test_bad_words_ban_the_token_that_would_complete_a_word(output, banned):
    words = [[4], [7, 9], [5, 6, 8]]
    got = ban_bad_words(torch.zeros(12), words, output)
    assert torch.isinf(got).nonzero().flatten().tolist() == banned


def test_bad_words_agree_with_transformers_when_the_prefix_is_in_the_output():
    words = [[4], [7, 9], [5, 6, 8]]
    output = [3, 5, 6]
    ours = ban_bad_words(torch.zeros(12), words, output)
    hf = logits_process.NoBadWordsLogitsProcessor(words, eos_token_id=11)
    theirs = hf(torch.tensor([output]), torch.zeros(1, 12))[0]
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))


@pytest.fixture(scope="module")
def engine():
    return LLMEngine("tiny-llama", max_model_len=64)


def test_allowed_tokens_and_a_bad_word_steer_greedy_decoding(engine):
    prompt, allowed = [1, 2, 3, 4], [65, 66, 67]  # "A", "B", "C"
    base = dict(max_tokens=6, ignore_eos=True, allowed_token_ids=allowed)
    (only,) = engine.generate([prompt], SamplingParams(**base))
    assert set(only.output_token_ids) <= set(allowed)
    favourite = only.output_token_ids[0]
    (banned,) = engine.generate([prompt], SamplingParams(**base, bad_words=[chr(favourite)]))
    assert favourite not in banned.output_token_ids
    assert set(banned.output_token_ids) <= set(allowed)


def test_prompt_logprobs_are_the_prompt_logits_log_softmax(engine):
    prompt = [5, 9, 33, 70, 12, 99, 3]
    params = SamplingParams(max_tokens=1, prompt_logprobs=2, prompt_logits=True)
    (out,) = engine.generate([prompt], params)
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    reference = torch.log_softmax(out.prompt_logits.double(), dim=-1)
    for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
        row = reference[i - 1]
        token = prompt[i]
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-5)
        assert entry[token].rank == int((row >= row[token]).sum())
        top = torch.topk(row, 2).indices.tolist()
        for rank, t in enumerate(top, start=1):
            assert entry[t].rank == rank
            assert math.isclose(entry[t].logprob, float(row[t]), abs_tol=1e-5)


def test_prompt_logprobs_survive_chunked_prefill():
    engine = LLMEngine("tiny-llama", max_num_batched_tokens=16)
    prompt = list(range(40, 80))
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, prompt_logits=True)
    (out,) = engine.generate([prompt], params)
    reference = torch.log_softmax(out.prompt_logits.double(), dim=-1)
    got = [entry[prompt[i]].logprob for i, entry in enumerate(out.prompt_logprobs) if i]
    want = [float(reference[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    assert got == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize(
    "include, stop, text", [(False, ["."], "Hello world"), (True, ["."], "Hello world.")]
)
def test_include_stop_str_in_output(engine, include, stop, text):
    script(engine, "Hello world. Bye")
    params = SamplingParams(max_tokens=16, stop=stop, include_stop_str_in_output=include)
    (out,) = engine.generate([[1, 2, 3]], params)
    completion = out.outputs[0]
    assert (completion.text, completion.finish_reason, completion.stop_reason) == (
        text, "stop", ".")  # fmt: skip


def test_include_stop_str_keeps_a_stop_tokens_text(engine):
    script(engine, "Hi! there")
    params = SamplingParams(max_tokens=16, stop_token_ids=[ord("!")])
    (plain,) = engine.generate([[1, 2, 3]], params)
    (kept,) = engine.generate(
        [[1, 2, 3]], SamplingParams(max_tokens=16, stop_token_ids=[ord("!")],
                                    include_stop_str_in_output=True)
    )  # fmt: skip
    assert (plain.text, kept.text) == ("Hi", "Hi!")


def test_skip_special_tokens_decides_whether_specials_are_spelled(tmp_path):
    from tests.models.test_tokenizer import save_word_tokenizer
    from unified_attn.models.tokenizer import load_tokenizer

    save_word_tokenizer(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    texts = []
    for skip in (True, False):
        text = IncrementalText(tokenizer, SamplingParams(skip_special_tokens=skip))
        text.add([3, 1, 4], 3, final=True)
        texts.append(text.text)
    assert texts == ["hello world", "hello </s> world"]


def test_num_cached_tokens_and_metrics(engine):
    prompt = list(range(100, 140))  # 40 tokens: two full 16-token blocks to share
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    (first,) = engine.generate([prompt], params)
    (second,) = engine.generate([prompt], params)
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 32)
    m = second.metrics
    assert m.arrival_time <= m.first_token_time <= m.last_token_time
    assert m.first_token_latency >= 0 and m.num_generation_tokens == 3 and m.num_preemptions == 0


@pytest.mark.parametrize(
    "params, message",
    [
        (dict(logit_bias={9999: 1.0}), "logit_bias holds 9999, outside the vocabulary"),
        (dict(allowed_token_ids=[3, 9999]), "allowed_token_ids holds 9999"),
        (dict(prompt_logprobs=100000), "prompt_logprobs=100000 exceeds the vocabulary"),
        (dict(bad_words=[" "]), "' ' spells no token"),
    ],
)
def test_options_the_model_cannot_honour_are_refused(engine, params, message):
    with pytest.raises(ValueError, match=message):
        engine.generate([[1, 2]], SamplingParams(**params))
