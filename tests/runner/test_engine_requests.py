"""`generate` next to requests added with `add_request`, automatic request ids, and seeded
sampling across preemption."""

import pytest

from unified_attn import LLMEngine, SamplingParams

LONG = SamplingParams(max_tokens=12, ignore_eos=True)
SHORT = SamplingParams(max_tokens=2, ignore_eos=True)


def drain(engine):
    """The final outputs of the requests `step()` runs (`add_request`'s default CUMULATIVE
    kind also returns every step's progress)."""
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    return outputs


def test_generate_returns_only_its_own_outputs_while_another_request_runs():
    engine = LLMEngine("tiny-llama")
    other = engine.add_request(None, [5, 6, 7, 8], LONG)
    (mine,) = engine.generate([[1, 2, 3]], SHORT)
    assert mine.request_id != other and len(mine.output_token_ids) == 2
    later = drain(engine)
    assert [o.request_id for o in later] == [other]
    assert len(later[0].output_token_ids) == 12


def test_an_output_that_finishes_during_generate_comes_from_the_next_step():
    engine = LLMEngine("tiny-llama")
    other = engine.add_request(None, [5, 6, 7, 8], SamplingParams(max_tokens=1, ignore_eos=True))
    outs = engine.generate([[1, 2, 3], [4, 5]], LONG)
    assert [len(o.output_token_ids) for o in outs] == [12, 12]
    assert not engine.scheduler.has_unfinished()
    assert engine.has_unfinished_requests()  # a serving loop on it does not miss the output
    (delivered,) = engine.step()  # nothing left to run: only the kept output
    assert delivered.request_id == other and len(delivered.output_token_ids) == 1
    assert engine.step() == []  # delivered once
    assert not engine.has_unfinished_requests()


def test_generate_queues_nothing_when_one_prompt_is_invalid():
    engine = LLMEngine("tiny-llama", max_model_len=64)
    with pytest.raises(ValueError, match="generate: prompt 1: token id 999"):
        engine.generate([[1, 2], [1, 999]], SHORT)
    assert not engine.has_unfinished_requests()


def test_generate_aborts_its_requests_when_interrupted(monkeypatch):
    engine = LLMEngine("tiny-llama")
    other = engine.add_request(None, [5, 6, 7, 8], LONG)

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(engine, "_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.generate([[1, 2, 3]], SHORT)
    monkeypatch.undo()
    assert list(engine.scheduler.requests) == [other]  # the other request is untouched
    assert [o.request_id for o in drain(engine)] == [other]


def test_automatic_ids_skip_ids_the_caller_chose():
    engine = LLMEngine("tiny-llama")
    engine.add_request("req-0", [1, 2], SHORT)
    engine.add_request("req-2", [1, 2], SHORT)
    automatic = [engine.add_request(None, [3, 4], SHORT) for _ in range(3)]
    assert len(set(automatic)) == 3 and not {"req-0", "req-2"} & set(automatic)
    assert sorted(o.request_id for o in drain(engine)) == sorted(["req-0", "req-2", *automatic])


def test_explicit_duplicate_ids_are_still_refused():
    engine = LLMEngine("tiny-llama")
    engine.add_request("a", [1, 2], SHORT)
    with pytest.raises(ValueError, match="'a' is already in use"):
        engine.add_request("a", [1, 2], SHORT)


def test_seeded_sampling_continues_its_stream_after_preemption():
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=11, ignore_eos=True)
    prompt = list(range(20))
    alone = LLMEngine("tiny-llama").generate([prompt], params)[0].output_token_ids
    page = 2 * 16 * 2 * 32 * 4 * 4  # a tiny-llama block: K+V, 2 kv heads, d32, fp32, 4 layers
    tight = LLMEngine(
        "tiny-llama", kv_cache_memory=page * 8, max_model_len=80, max_num_batched_tokens=64
    )
    # the newest running request is preempted first: the seeded one comes last
    crowd = [[7 + i] * 20 for i in range(2)]
    outs = tight.generate([*crowd, prompt], [SamplingParams(max_tokens=40)] * 2 + [params])
    assert outs[-1].num_preemptions > 0
    assert outs[-1].output_token_ids == alone


@pytest.mark.parametrize("device, message", [("gpu", "not a device name"), ("mps", "not mps")])
def test_unknown_devices_are_refused_before_anything_is_built(device, message):
    with pytest.raises(ValueError, match=message):
        LLMEngine("tiny-llama", device=device)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(request_id=7), "request_id must be a non-empty str or None .* got 7"),
        (dict(request_id=""), "request_id must be a non-empty str"),
        (dict(cache_salt=b"x"), "cache_salt must be a str or None"),
        (dict(params=SamplingParams(stop_token_ids=[999])), "stop_token_ids holds 999"),
        (dict(params=SamplingParams(logprobs=1000)), "logprobs=1000 exceeds the vocabulary"),
        (dict(params=dict(max_tokens=2)), "expected SamplingParams, got dict"),
    ],
)
def test_bad_request_arguments_are_refused_and_change_nothing(kwargs, message):
    engine = LLMEngine("tiny-llama")
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt=[1, 2], **kwargs)
    assert not engine.has_unfinished_requests() and engine.unfinished_request_ids() == []
    assert engine.add_request(None, [1, 2]) == "req-0"  # no automatic id was used up


@pytest.mark.parametrize("fraction", [0, 1.5, -0.1, "0.9", True])
def test_a_gpu_memory_fraction_outside_0_1_is_refused(fraction):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be a fraction in"):
        LLMEngine("tiny-llama", gpu_memory_utilization=fraction)
