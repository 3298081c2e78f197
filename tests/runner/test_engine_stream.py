"""`LLMEngine.stream` (per-step deltas while other requests run) and `abort_request` (an output
with `finish_reason="abort"` wherever the request's caller is)."""

import pytest

from unified_attn import LLMEngine, SamplingParams
from unified_attn.sampling_params import RequestOutputKind

SEEDED = SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=4, logprobs=2, ignore_eos=True)
LONG = SamplingParams(max_tokens=12, ignore_eos=True)
FINAL = SamplingParams(max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
PROMPTS = [[1, 2, 3, 4], [9, 8, 7]]


def drain(engine):
    """The final outputs of the requests `step()` runs (`add_request`'s default CUMULATIVE
    kind also returns every step's progress)."""
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    return outputs


def joined(deltas, request_id, index):
    """(token ids, text, finish reason, sampled logprobs) of one completion's deltas."""
    mine = [d for d in deltas if (d.request_id, d.index) == (request_id, index)]
    assert [d.finished for d in mine] == [False] * (len(mine) - 1) + [True]
    tokens = [t for d in mine for t in d.token_ids]
    logprobs = [lp[t].logprob for d in mine for lp, t in zip(d.logprobs, d.token_ids, strict=True)]
    return tokens, "".join(d.text for d in mine), mine[-1].finish_reason, logprobs


def as_joined(completion):
    pairs = zip(completion.logprobs, completion.token_ids, strict=True)
    logprobs = [lp[t].logprob for lp, t in pairs]
    return completion.token_ids, completion.text, completion.finish_reason, logprobs


@pytest.fixture
def engine():
    return LLMEngine("tiny-llama")


# ---- streams -----------------------------------------------------------------------------------


def test_a_stream_adds_up_to_the_same_outputs_as_generate_while_another_request_runs(engine):
    other = engine.add_request(None, [5, 6, 7, 8], LONG)
    deltas = list(engine.stream(PROMPTS, SEEDED))
    ids = list(dict.fromkeys(d.request_id for d in deltas))
    assert len(ids) == 2 and other not in ids
    assert engine.unfinished_request_ids() == [other]  # it ran alongside, it is not done
    outs = engine.generate(PROMPTS, SEEDED)
    for rid, out in zip(ids, outs, strict=True):
        for index in (0, 1):
            *got, got_logprobs = joined(deltas, rid, index)
            *want, want_logprobs = as_joined(out.outputs[index])
            assert got == want
            assert got_logprobs == pytest.approx(want_logprobs, abs=1e-5)  # other batches
    (later,) = drain(engine)  # the other request's output was not taken by the stream
    assert later.request_id == other and len(later.output_token_ids) == 12


def test_a_stream_validates_now_and_queues_when_iterated(engine):
    with pytest.raises(ValueError, match="stream: prompt 1: the prompt is empty"):
        engine.stream([[1], []])
    stream = engine.stream([[1, 2]], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished_requests()
    first = next(stream)
    assert engine.unfinished_request_ids() == [first.request_id]
    assert [d.finished for d in stream] == [True]


def test_closing_a_stream_aborts_its_requests_and_leaves_the_others(engine):
    other = engine.add_request(None, [5, 6, 7, 8], LONG)
    stream = engine.stream(PROMPTS, SEEDED)
    first = next(stream)
    stream.close()
    assert engine.unfinished_request_ids() == [other]
    assert list(engine.scheduler.requests) == [other]
    outs = drain(engine)  # no output for the closed stream's requests
    assert [o.request_id for o in outs] == [other]
    assert first.request_id not in engine.unfinished_request_ids()


def test_interleaved_streams_each_get_their_own_deltas(engine):
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    a, b = engine.stream([[1, 2]], params), engine.stream([[3, 4, 5]], params)
    got: dict[str, list] = {"a": [], "b": []}
    for _ in range(5):
        got["a"].append(next(a))
        got["b"].append(next(b))
    assert next(a, None) is None and next(b, None) is None
    assert len({d.request_id for d in got["a"]}) == len({d.request_id for d in got["b"]}) == 1
    solo = engine.generate([[1, 2], [3, 4, 5]], params)
    for name, out in zip("ab", solo, strict=True):
        assert [t for d in got[name] for t in d.token_ids] == out.output_token_ids


def test_a_stream_whose_step_fails_drops_its_requests(engine, monkeypatch):
    other = engine.add_request(None, [5, 6, 7, 8], LONG)
    stream = engine.stream(PROMPTS, SEEDED)
    next(stream)

    def failing():
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "_step", failing)
    with pytest.raises(RuntimeError, match="boom"):
        list(stream)
    monkeypatch.undo()
    assert engine.unfinished_request_ids() == [other]
    assert [o.request_id for o in drain(engine)] == [other]


# ---- aborts ------------------------------------------------------------------------------------


def test_aborting_unknown_or_finished_ids_is_ignored_as_in_vllm(engine):
    engine.abort_request("nope")
    rid = engine.add_request(None, [1, 2], SamplingParams(n=2, max_tokens=2))
    engine.abort_request([f"{rid}#0", "nope"])  # a completion's scheduler id is no request id
    assert engine.unfinished_request_ids() == [rid]
    (out,) = drain(engine)
    assert [c.finish_reason for c in out.outputs] == ["length", "length"]
    engine.abort_request([rid])  # a client that leaves as its request finishes
    assert engine.step() == []


@pytest.mark.parametrize("ids", [7, [None], ["a", 3]])
def test_abort_ids_that_are_not_strings_are_refused_before_any_abort(engine, ids):
    rid = engine.add_request("a", [1, 2], LONG)
    with pytest.raises(ValueError, match="request ids must be str"):
        engine.abort_request(ids)
    assert engine.unfinished_request_ids() == [rid]


def test_an_aborted_request_hands_back_what_it_generated(engine):
    full = engine.generate([[1, 2, 3]], LONG)[0].output_token_ids
    rid = engine.add_request(None, [1, 2, 3], FINAL)
    for _ in range(4):
        assert engine.step() == []
    engine.abort_request(rid)
    assert engine.kv_cache_manager.usage == 0
    engine.abort_request(rid)  # a second time: nothing left to abort
    (out,) = engine.step()
    assert (out.request_id, out.finish_reason, out.outputs[0].finish_reason) == (
        rid,
        "abort",
        "abort",
    )
    assert out.output_token_ids == full[:4]
    assert out.text == engine.tokenizer.decode(full[:4])
    assert not engine.has_unfinished_requests()


def test_an_aborted_waiting_request_has_an_empty_output():
    engine = LLMEngine("tiny-llama", max_num_seqs=1)
    engine.add_request(None, [1, 2], FINAL)
    waiting = engine.add_request(None, [3, 4], SamplingParams(n=2, max_tokens=3))
    engine.step()
    engine.abort_request(waiting)
    (out,) = engine.step()
    assert [(c.token_ids, c.finish_reason) for c in out.outputs] == [([], "abort")] * 2


def test_aborting_a_streamed_request_ends_its_completions_with_abort(engine):
    deltas = []
    for delta in engine.stream([[1, 2, 3]], SEEDED):
        deltas.append(delta)
        if len(deltas) == 4:  # two steps of both completions
            engine.abort_request(delta.request_id)
    assert [(d.index, d.finish_reason, d.token_ids) for d in deltas[4:]] == [
        (0, "abort", []),
        (1, "abort", []),
    ]
    assert engine.step() == []  # a stream's request has no output of its own


def test_aborting_a_request_that_generate_runs_returns_it_aborted(engine, monkeypatch):
    step, calls = engine._step, []

    def step_then_abort():
        step()
        calls.append(1)
        if len(calls) == 3:
            engine.abort_request(engine.unfinished_request_ids()[0])

    monkeypatch.setattr(engine, "_step", step_then_abort)
    first, second = engine.generate(PROMPTS, LONG)
    assert (first.finish_reason, len(first.output_token_ids)) == ("abort", 3)
    assert (second.finish_reason, len(second.output_token_ids)) == ("length", 12)
    assert engine.step() == []
