"""The serving loop as vLLM's `LLMEngine` has it: `add_request(request_id, prompt, params)`,
`step()` returning an output for every request the step advanced (whole so far, or what the
step added, by `SamplingParams.output_kind`), `abort_request` of a list that may hold finished
or unknown ids, and the unfinished counts."""

import pytest

from unified_attn import LLMEngine, SamplingParams
from unified_attn.sampling_params import RequestOutputKind

PROMPT = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def engine():
    return LLMEngine("tiny-llama")


def params(kind, **options):
    options.setdefault("max_tokens", 5)
    return SamplingParams(ignore_eos=True, output_kind=kind, **options)


def loop(engine):
    """A vLLM-style loop: every output of every step, by request id."""
    seen = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


def test_a_vllm_style_loop_sees_cumulative_delta_and_final_outputs(engine):
    (want,) = engine.generate([PROMPT], params(RequestOutputKind.FINAL_ONLY))
    engine.add_request("cumulative", PROMPT, params(RequestOutputKind.CUMULATIVE))
    engine.add_request("delta", PROMPT, params(RequestOutputKind.DELTA))
    engine.add_request("final", PROMPT, params(RequestOutputKind.FINAL_ONLY))
    seen = loop(engine)
    cumulative, delta, final = seen["cumulative"], seen["delta"], seen["final"]
    assert [len(o.outputs[0].token_ids) for o in cumulative] == [1, 2, 3, 4, 5]
    assert [o.finished for o in cumulative] == [False] * 4 + [True]
    assert [len(o.outputs[0].token_ids) for o in delta] == [1] * 5
    assert [t for o in delta for t in o.outputs[0].token_ids] == want.output_token_ids
    assert "".join(o.outputs[0].text for o in delta) == want.text
    assert cumulative[-1].outputs[0].token_ids == want.output_token_ids
    assert cumulative[-1].outputs[0].text == want.text
    assert cumulative[2].outputs[0].text == engine.tokenizer.decode(want.output_token_ids[:3])
    assert [o.finished for o in final] == [True] and final[0].outputs[0].token_ids == (
        want.output_token_ids
    )
    assert delta[-1].outputs[0].finish_reason == "length"
    assert [o.outputs[0].finish_reason for o in delta[:-1]] == [None] * 4


def test_delta_logprobs_add_up_to_the_final_ones(engine):
    sp = dict(logprobs=2, temperature=1.0, seed=3)
    (want,) = engine.generate([PROMPT], params(RequestOutputKind.FINAL_ONLY, **sp))
    engine.add_request("d", PROMPT, params(RequestOutputKind.DELTA, **sp))
    deltas = loop(engine)["d"]
    got = [entry for o in deltas for entry in o.outputs[0].logprobs]
    assert [list(e) for e in got] == [list(e) for e in want.outputs[0].logprobs]
    assert deltas[-1].outputs[0].cumulative_logprob == pytest.approx(
        want.outputs[0].cumulative_logprob, abs=1e-5
    )


def test_n_completions_report_what_each_step_advanced(engine):
    engine.add_request("n", PROMPT, params(RequestOutputKind.CUMULATIVE, n=2, max_tokens=3))
    assert engine.get_num_unfinished_requests() == 2  # vLLM counts each completion
    outs = loop(engine)["n"]
    assert [sorted(c.index for c in o.outputs) for o in outs] == [[0, 1]] * 3
    assert [o.finished for o in outs] == [False, False, True]
    assert engine.get_num_unfinished_requests() == 0


def test_abort_takes_a_list_and_ignores_finished_and_unknown_ids(engine):
    done = engine.add_request("done", PROMPT, params(RequestOutputKind.FINAL_ONLY, max_tokens=1))
    engine.add_request("running", PROMPT, params(RequestOutputKind.FINAL_ONLY, max_tokens=50))
    (out,) = engine.step()
    assert out.request_id == done and out.finished
    engine.abort_request([done, "running", "never-added"])
    (aborted,) = engine.step()
    assert (aborted.request_id, aborted.finish_reason) == ("running", "abort")
    assert not engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (([1, 2], SamplingParams()), r"request_id must be a non-empty str .* got \[1, 2\]; "
         r"the call is add_request\(request_id, prompt, params\)"),
        (("hello",), "no prompt given; the call is add_request"),
    ],
)  # fmt: skip
def test_the_pre_vllm_argument_order_is_refused_with_the_right_call(engine, args, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request(*args)
    assert not engine.has_unfinished_requests()


def test_keyword_calls_keep_working(engine):
    rid = engine.add_request(prompt=PROMPT, params=params(RequestOutputKind.FINAL_ONLY))
    (out,) = [o for o in loop(engine)[rid]]
    assert out.finished and len(out.output_token_ids) == 5
