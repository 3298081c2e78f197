"""The engine end to end on the tiny preset: chunked prefill, prefix caching and preemption
never change outputs; bad input is rejected and the engine stays usable."""

import random

import pytest

from unified_attn import LLMEngine, SamplingParams


def prompts(n=12, seed=0, vocab=256):
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(40)]
    return [shared + [rng.randrange(vocab) for _ in range(rng.randint(3, 30))] for _ in range(n)]


GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def tokens(engine, batch, params=GREEDY):
    return [out.output_token_ids for out in engine.generate(batch, params)]


@pytest.fixture(scope="module")
def baseline():
    engine = LLMEngine("tiny-llama", enable_prefix_caching=False, max_num_batched_tokens=4096)
    return tokens(engine, prompts())


def test_chunked_prefill_gives_the_same_tokens(baseline):
    engine = LLMEngine("tiny-llama", max_num_batched_tokens=16, enable_prefix_caching=False)
    assert tokens(engine, prompts()) == baseline
    assert engine.stats.steps > 40


def test_prefix_caching_gives_the_same_tokens_and_hits(baseline):
    engine = LLMEngine("tiny-llama", max_num_batched_tokens=4096)
    first = tokens(engine, prompts()[:1])
    assert tokens(engine, prompts()) == baseline
    assert first == baseline[:1]
    assert engine.kv_cache_manager.prefix_cache_stats.hits >= 11 * 32


def test_preemption_gives_the_same_tokens(baseline):
    # 16 blocks of 16 tokens: far too few for 12 concurrent requests of ~70 tokens.
    page = 2 * 16 * 2 * 32 * 4 * 4  # K+V, 16 tokens, 2 kv heads, head 32, fp32, 4 layers
    engine = LLMEngine(
        "tiny-llama", kv_cache_memory=page * 16, max_model_len=128, max_num_batched_tokens=64
    )
    assert tokens(engine, prompts()) == baseline
    assert engine.scheduler.num_preemptions > 0


def test_stop_conditions():
    engine = LLMEngine("tiny-llama")
    first = engine.generate([prompts()[0]], GREEDY)[0]
    stop_at = first.output_token_ids[3]
    out = engine.generate([prompts()[0]], SamplingParams(max_tokens=12, stop_token_ids=[stop_at]))[
        0
    ]
    assert (
        out.output_token_ids == first.output_token_ids[: first.output_token_ids.index(stop_at) + 1]
    )
    assert out.finish_reason == "stop" and first.finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_differs_from_greedy():
    engine = LLMEngine("tiny-llama")
    params = SamplingParams(max_tokens=10, temperature=1.0, top_k=50, top_p=0.9, seed=7)
    a = tokens(engine, prompts()[:2], params)
    b = tokens(engine, prompts()[:2], params)
    assert a == b
    assert a != tokens(engine, prompts()[:2])


def test_text_prompts_round_trip_through_the_tokenizer():
    engine = LLMEngine("tiny-llama")
    out = engine.generate("Hello, unified attention!", SamplingParams(max_tokens=4))[0]
    assert out.prompt_token_ids == list(b"Hello, unified attention!")
    assert isinstance(out.text, str)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], "the prompt is empty"),
        ([1] * 300, "leaves no room to generate"),
        ([1, 2, 999], "token id 999 is outside the vocabulary"),
    ],
)
def test_bad_prompts_are_rejected_and_the_engine_stays_usable(prompt, message):
    engine = LLMEngine("tiny-llama", max_model_len=256)
    with pytest.raises(ValueError, match=message):
        engine.add_request(None, prompt)
    assert not engine.has_unfinished_requests()
    assert len(engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].output_token_ids) == 2


def test_kv_budget_too_small_for_one_request():
    with pytest.raises(ValueError, match=r"needs .* MiB .* only .* MiB .* largest max_model_len"):
        LLMEngine("tiny-llama", kv_cache_memory="1MiB", max_model_len=2048)


def test_unknown_backend_and_model_names():
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'.*reference"):
        LLMEngine("tiny-llama", backend="flash")
    with pytest.raises(ValueError, match="neither a preset"):
        LLMEngine("no-such-model")


def test_abort_frees_blocks():
    engine = LLMEngine("tiny-llama")
    rid = engine.add_request(None, prompts()[0], GREEDY)
    engine.step()
    assert engine.kv_cache_manager.usage > 0
    engine.abort_request(rid)
    assert engine.kv_cache_manager.usage == 0 and not engine.scheduler.has_unfinished()
    (out,) = engine.step()  # the aborted request's output, with what it generated
    assert (out.request_id, out.finish_reason) == (rid, "abort")
    assert not engine.has_unfinished_requests()
