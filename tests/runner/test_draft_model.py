"""Speculative decoding with a draft model: greedy outputs equal decoding without drafts (for
drafts of every manager kind, chunked catch-up, the draft's length limit), the KV budget is
shared, the draft's pool is left empty, and bad settings are refused."""

from __future__ import annotations

import json

import pytest

from tests.models.hf_encoder_models import make_hf_bart
from tests.models.hf_encoder_models import save_hf_model as save_encoder_model
from tests.models.hf_models import make_hf_model, save_hf_model
from unified_attn import LLMEngine, SamplingParams
from unified_attn.spec_decode.draft_model import DraftModelProposer


def draft_options(draft_model: str, k: int = 4) -> dict:
    return dict(speculative_method="draft", draft_model=draft_model, num_speculative_tokens=k)


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 6, list(range(40, 80)), [3, 4, 3, 4, 3, 4] * 5]
GREEDY = [
    SamplingParams(max_tokens=20, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=7, ignore_eos=True, min_tokens=3, presence_penalty=0.5),
    SamplingParams(max_tokens=30, ignore_eos=True, repetition_penalty=1.2),
]


def drafter_of(engine: LLMEngine) -> DraftModelProposer:
    assert isinstance(engine.drafter, DraftModelProposer)
    return engine.drafter


def check_draft_pool_is_empty(engine: LLMEngine) -> None:
    drafter = drafter_of(engine)
    assert drafter.num_shadows == 0 and drafter.kv_cache_manager.usage == 0.0
    assert not drafter.runner.block_tables.rows


def test_a_draft_model_equal_to_the_target_is_always_accepted():
    """Self-drafting (the same preset and seed: the same weights) proposes the target's own
    greedy tokens, so nearly every draft is accepted and a step adds about k + 1 tokens (the
    draft applies no penalties: requests with penalties would reject more)."""
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = LLMEngine("tiny-llama").generate(PROMPTS, params)
    engine = LLMEngine("tiny-llama", **draft_options("tiny-llama"))
    spec = engine.generate(PROMPTS, params)
    for a, b in zip(plain, spec, strict=True):
        assert a.output_token_ids == b.output_token_ids
    stats = engine.stats
    assert stats.spec_acceptance_rate > 0.9 and stats.mean_accepted_per_step > 3
    assert stats.steps <= 12  # a prefill step, then about 30 / 5 decode steps
    check_draft_pool_is_empty(engine)


@pytest.mark.parametrize("draft", ["mistral-like", "llama4-like", "streaming-llm", "gpt-oss-like"])
def test_drafts_of_any_kind_keep_the_greedy_outputs(draft):
    """Draft models whose caches slide, chunk or keep sinks roll back rejected drafts: the
    outputs (tokens, log-probabilities) equal decoding without drafts."""
    plain = LLMEngine("tiny-hybrid").generate(PROMPTS, GREEDY)
    engine = LLMEngine("tiny-hybrid", **draft_options(draft))
    spec = engine.generate(PROMPTS, GREEDY)
    for a, b in zip(plain, spec, strict=True):
        assert a.output_token_ids == b.output_token_ids
        for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True):
            assert x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-5 for t in x)
    assert engine.stats.spec_drafted > 0
    check_draft_pool_is_empty(engine)


def test_long_prompts_catch_up_in_chunks_of_the_token_budget():
    """A prompt longer than `max_num_batched_tokens` enters the draft's cache in chunks."""
    options = dict(max_num_batched_tokens=32, max_num_seqs=4)
    prompts = [list(range(1, 101)), [7, 8, 9] * 30]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = LLMEngine("tiny-llama", **options).generate(prompts, params)
    engine = LLMEngine("tiny-llama", **options, **draft_options("tiny-llama", k=3))
    spec = engine.generate(prompts, params)
    assert [o.output_token_ids for o in spec] == [o.output_token_ids for o in plain]
    assert engine.stats.spec_acceptance_rate > 0.9
    check_draft_pool_is_empty(engine)


def test_requests_past_the_draft_models_length_decode_without_drafts():
    engine = LLMEngine("tiny-llama", **draft_options("tiny-llama"))
    drafter_of(engine).max_model_len = 60  # as if the draft model were shorter
    prompt = list(range(1, 51))
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    (out,) = engine.generate([prompt], params)
    (want,) = LLMEngine("tiny-llama").generate([prompt], params)
    assert out.output_token_ids == want.output_token_ids
    # drafts only while the sequence is shorter than 60 tokens
    assert 0 < engine.stats.spec_drafted <= 10


def test_aborted_and_preempted_requests_free_their_draft_blocks():
    engine = LLMEngine("tiny-llama", **draft_options("mistral-like", k=3))
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    first = engine.add_request(None, PROMPTS[0], params)
    engine.add_request(None, PROMPTS[1], params)
    for _ in range(3):
        engine.step()
    assert drafter_of(engine).num_shadows == 2
    engine.abort_request(first)
    while engine.has_unfinished_requests():
        engine.step()
    check_draft_pool_is_empty(engine)


def test_sampled_requests_are_reproducible_with_a_seed():
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True)
    runs = [
        LLMEngine("tiny-llama", **draft_options("mistral-like")).generate(PROMPTS, params)
        for _ in range(2)
    ]
    assert [o.output_token_ids for o in runs[0]] == [o.output_token_ids for o in runs[1]]
    assert all(len(o.output_token_ids) == 24 for o in runs[0])


def test_the_kv_budget_is_shared_by_bytes_per_token():
    """Both pools hold about as many tokens; the target's cache shrinks to make room."""
    plain = LLMEngine("tiny-llama", kv_cache_memory="16MiB")
    engine = LLMEngine("tiny-llama", kv_cache_memory="16MiB", **draft_options("tiny-llama"))
    draft = drafter_of(engine).worker
    assert engine.worker.num_blocks == plain.worker.num_blocks // 2
    assert draft.num_blocks * draft.plan.block_size == pytest.approx(
        engine.worker.num_blocks * engine.worker.plan.block_size, rel=0.01
    )
    total = engine.worker.kv_buffer.numel() + draft.kv_buffer.numel()
    assert total <= 16 * 2**20


def test_a_checkpoint_drafts_for_a_checkpoint(tmp_path):
    """A Qwen2 draft for a Llama target (transformers checkpoints with one tokenizer size)."""
    target = save_hf_model(make_hf_model("llama", num_hidden_layers=2), tmp_path / "llama")
    draft = save_hf_model(make_hf_model("qwen2", num_hidden_layers=1, seed=3), tmp_path / "qwen")
    prompts = [[5, 6, 7, 8] * 6, list(range(10, 40))]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = LLMEngine(str(target), kv_cache_memory="2MiB").generate(prompts, params)
    engine = LLMEngine(str(target), kv_cache_memory="2MiB", **draft_options(str(draft)))
    spec = engine.generate(prompts, params)
    assert [o.output_token_ids for o in spec] == [o.output_token_ids for o in plain]
    assert engine.stats.spec_drafted > 0
    check_draft_pool_is_empty(engine)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(speculative_method="draft", num_speculative_tokens=3), "needs draft_model"),
        (dict(draft_model="tiny-llama", num_speculative_tokens=3), "needs speculative_method"),
        (
            dict(speculative_method="ngram", draft_model="tiny-llama", num_speculative_tokens=3),
            "draft_model='tiny-llama' needs speculative_method='draft', got 'ngram'",
        ),
        (draft_options("hybrid-linear"), "state layers .* cannot roll back rejected drafts"),
        (draft_options("tiny-llama", k=0), "needs num_speculative_tokens, a positive int"),
        (
            dict(draft_options("tiny-llama"), kv_cache_memory="40KiB"),
            "draft_model='tiny-llama': the KV cache needs",
        ),
    ],
)
def test_bad_draft_settings_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        LLMEngine("tiny-llama", **options)


def test_draft_models_the_target_cannot_read_are_refused(tmp_path):
    target = save_hf_model(make_hf_model("llama", num_hidden_layers=1), tmp_path / "llama")
    bart = save_encoder_model(make_hf_bart(), tmp_path / "bart")
    options = dict(kv_cache_memory="2MiB")
    with pytest.raises(ValueError, match="vocabulary of 384 tokens, more than the target's 128"):
        LLMEngine(str(target), **options, **draft_options("tiny-llama"))
    with pytest.raises(ValueError, match="encoder-decoder model; a draft model must be"):
        LLMEngine(str(target), **options, **draft_options(str(bart)))


def test_the_run_command_takes_a_draft_model(capsys):
    from unified_attn.cli import main

    argv = ["run", "--num-requests", "3", "--max-tokens", "12", "--json",
            "--speculative-method", "draft", "--draft-model", "tiny-llama",
            "--num-speculative-tokens", "3"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    spec = report["speculative"]
    assert spec["method"] == "draft" and spec["draft_model"] == "tiny-llama"
    assert spec["acceptance_rate"] > 0.9
    assert report["draft_kv_cache"]["num_blocks"] > 0


def test_catch_up_ends_when_the_target_took_a_draft_it_did_not_verify():
    """The state a soak spun on: the target's step had no room to verify its drafts, decoded
    one token, and that token was the shadow's first draft, which the draft cache already holds
    (fed to propose the second). The shadow then has nothing left to compute, yet needs the
    last token's logits for its first draft: it computes that token again, and the round ends
    with the drafts a fresh shadow would propose."""
    import threading

    from unified_attn.request import Request, RequestStatus

    engine = LLMEngine("tiny-llama", **draft_options("tiny-llama", k=3))
    drafter = drafter_of(engine)
    target = Request("r", PROMPTS[1], sampling_params=SamplingParams(max_tokens=20))
    target.status = RequestStatus.RUNNING
    target.append_output_token_ids([7])
    drafter.draft([(target, 3)])
    first = target.spec_token_ids
    assert len(first) == 3
    target.append_output_token_ids(first[:1])  # decoded alone, equal to the first draft
    shadow = drafter._shadows["r"].request
    assert shadow.num_computed_tokens >= target.num_tokens  # the state that spun

    round_ = threading.Thread(target=drafter.draft, args=([(target, 3)],), daemon=True)
    round_.start()
    round_.join(timeout=60)
    assert not round_.is_alive(), "the draft round did not end"
    assert target.spec_token_ids == first[1:] + target.spec_token_ids[2:]  # the same greedy run

    fresh = LLMEngine("tiny-llama", **draft_options("tiny-llama", k=3))
    other = Request("r", PROMPTS[1], sampling_params=SamplingParams(max_tokens=20))
    other.status = RequestStatus.RUNNING
    other.append_output_token_ids(target.output_token_ids)
    drafter_of(fresh).draft([(other, 3)])
    assert other.spec_token_ids == target.spec_token_ids
