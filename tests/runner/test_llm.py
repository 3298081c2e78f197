"""`LLM`, vLLM's offline interface: the quick start, prompt forms, `n` completions, and the
model's own logits against hand-computed penalties and log-probabilities."""

import pytest
import torch

from unified_attn import LLM, CompletionOutput, LLMEngine, RequestOutput, SamplingParams

PROMPT = list(range(40))  # more than two blocks of 16: completions share two cached blocks


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama")


def test_vllms_quick_start_runs_as_written(llm, capsys):
    prompts = ["Hello, my name is", "The capital of France is"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.95))
    print(outs[0].outputs[0].text)
    assert isinstance(capsys.readouterr().out, str)
    assert [type(o) for o in outs] == [RequestOutput, RequestOutput]
    for out, prompt in zip(outs, prompts, strict=True):
        assert out.prompt == prompt and out.prompt_token_ids == list(prompt.encode())
        assert out.finished
        (completion,) = out.outputs
        assert isinstance(completion, CompletionOutput) and completion.index == 0
        assert 1 <= len(completion.token_ids) <= 16 and isinstance(completion.text, str)
        assert completion.finish_reason in ("stop", "length") and completion.finished()
        assert completion.logprobs is None and completion.cumulative_logprob is None
    assert outs[0].request_id != outs[1].request_id


def test_the_flat_fields_are_the_first_completions(llm):
    out = llm.generate("abc", SamplingParams(max_tokens=4, ignore_eos=True))[0]
    first = out.outputs[0]
    assert (out.output_token_ids, out.text, out.finish_reason) == (
        first.token_ids,
        first.text,
        first.finish_reason,
    )


def test_every_prompt_form_gives_the_same_tokens(llm):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ids = list(b"unified")
    forms = ["unified", ids, {"prompt": "unified"}, {"prompt_token_ids": ids}]
    outs = [llm.generate(form, params) for form in forms]
    assert all(len(o) == 1 for o in outs)
    assert len({tuple(o[0].output_token_ids) for o in outs}) == 1
    assert [o[0].prompt for o in outs] == ["unified", None, "unified", None]
    mixed = llm.generate(forms, params)  # a list of prompts of every form
    assert [o.output_token_ids for o in mixed] == [o[0].output_token_ids for o in outs]
    assert llm.generate([], params) == []


@pytest.mark.parametrize(
    "prompt, message",
    [
        ({"prompt": "a", "prompt_token_ids": [1]}, "exactly one of"),
        ({"text": "a"}, r"one of \['prompt', 'prompt_token_ids'\].*got the keys \['text'\]"),
        ({"prompt": [1, 2]}, "'prompt' must be text"),
        ({"prompt_token_ids": "ab"}, "'prompt_token_ids' must be token ids, got text"),
        ([[1, 2], [1.5]], "prompt 1: token ids must be ints, got 1.5"),
        ([[1, 2], [True]], "prompt 1: token ids must be ints, got True"),
        ([[1], b"ab"], "prompt 1: a prompt must be text, a list of token ids or a dict"),
    ],
)
def test_bad_prompts_are_refused_before_anything_is_queued(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, SamplingParams(max_tokens=2))
    assert not llm.llm_engine.has_unfinished_requests()


def test_bad_sampling_params_and_use_tqdm_are_refused(llm):
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        llm.generate(["a", "b"], [SamplingParams()])
    with pytest.raises(ValueError, match="prompt 0: expected SamplingParams, got dict"):
        llm.generate(["a"], [{"max_tokens": 2}])
    with pytest.raises(ValueError, match="use_tqdm must be True or False, got 'yes'"):
        llm.generate("a", use_tqdm="yes")  # type: ignore[arg-type]
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate("a", SamplingParams(max_tokens=2), use_tqdm=False)) == 1


def test_unknown_engine_options_are_refused_with_a_hint():
    with pytest.raises(ValueError, match=r"'pipeline_parallel_size' \(use tensor_parallel_size"):
        LLM("tiny-llama", pipeline_parallel_size=2)
    with pytest.raises(ValueError, match=r"'enforce_eager' \(pass cuda_graphs=False.*max_num_seqs"):
        LLMEngine("tiny-llama", enforce_eager=True)


# ---- n completions -----------------------------------------------------------------------------


def test_n_seeded_completions_use_seed_seed_plus_1_and_share_the_prompt_cache(llm):
    engine = llm.llm_engine
    params = dict(max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
    hits = engine.kv_cache_manager.prefix_cache_stats.hits
    (out,) = llm.generate([PROMPT], SamplingParams(n=3, **params))
    assert engine.kv_cache_manager.prefix_cache_stats.hits - hits >= 2 * 32
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for i, completion in enumerate(out.outputs):
        single = llm.generate([PROMPT], SamplingParams(**{**params, "seed": 5 + i}))[0]
        assert completion.token_ids == single.output_token_ids
        assert completion.text == single.text
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_n_greedy_completions_are_equal_and_gathered_under_one_id(llm):
    engine = llm.llm_engine
    rid = engine.add_request(None, PROMPT, SamplingParams(n=2, max_tokens=3, ignore_eos=True))
    assert engine.unfinished_request_ids() == [rid]
    assert sorted(engine.scheduler.requests) == [f"{rid}#0", f"{rid}#1"]
    with pytest.raises(ValueError, match=f"request id '{rid}#1' is already in use"):
        engine.add_request(f"{rid}#1", [1])
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    (out,) = outs
    assert out.request_id == rid and len(out.outputs) == 2
    assert out.outputs[0].token_ids == out.outputs[1].token_ids


# ---- the model's logits: penalties and log-probabilities by hand -------------------------------


def penalized(logits, prompt, output, presence, frequency, repetition):
    """vLLM's penalties, written out token by token."""
    out = logits.clone()
    for token in range(len(out)):
        count = output.count(token)
        if count or token in prompt:
            out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
        out[token] -= frequency * count + presence * (count > 0)
    return out


def test_greedy_tokens_are_the_argmax_of_the_penalized_logits(llm):
    pen = dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.6)
    params = SamplingParams(max_tokens=10, ignore_eos=True, return_logits=True, **pen)
    (out,) = llm.generate([PROMPT[:12]], params)
    assert out.logits is not None and out.logits.shape == (10, 384)
    tokens = out.output_token_ids
    for j, raw in enumerate(out.logits):  # the raw logits of step j
        expected = penalized(raw, PROMPT[:12], tokens[:j], 0.7, 0.4, 1.6)
        assert tokens[j] == int(expected.argmax())
    plain = llm.generate([PROMPT[:12]], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert plain.output_token_ids != tokens  # the penalties changed something


def test_logprobs_are_vllms_shape_over_the_raw_logits(llm):
    params = SamplingParams(
        max_tokens=5, temperature=1.0, seed=3, logprobs=3, return_logits=True, ignore_eos=True
    )
    completion = llm.generate([PROMPT], params)[0].outputs[0]
    assert completion.logprobs is not None and completion.logits is not None
    assert len(completion.logprobs) == len(completion.token_ids) == 5
    total = 0.0
    for token, entry, raw in zip(
        completion.token_ids, completion.logprobs, completion.logits, strict=True
    ):
        ref = torch.log_softmax(raw, dim=-1)
        top = ref.topk(3).indices.tolist()
        assert next(iter(entry)) == token and set(entry) == {token, *top}
        assert entry[token].logprob == pytest.approx(ref[token].item(), abs=1e-5)
        assert entry[token].rank == int((ref >= ref[token]).sum())
        assert [entry[t].rank for t in top] == [1, 2, 3]
        assert [entry[t].logprob for t in top] == pytest.approx(ref[top].tolist(), abs=1e-5)
        assert entry[token].decoded_token == llm.get_tokenizer().decode([token])
        total += ref[token].item()
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)
