"""Overlapped steps (`engine/step_loop.py`, `async_scheduling=True`): each step is scheduled
and launched before the previous step's tokens reach the host. On the CPU the device work is
synchronous, but the bookkeeping is the same as on a GPU: placeholders, tokens fed from the
device, tokens dropped after a stop, preemption with a token in flight. The tokens must be
those of plain steps. (The randomized soak runs the same option: tests/runner/test_soak.py.)"""

from __future__ import annotations

import attrs
import pytest
import torch

from unified_attn import LLMEngine, SamplingParams
from unified_attn.engine.step_loop import overlappable
from unified_attn.request import Request
from unified_attn.sampling_params import RequestOutputKind

ENGINE = dict(max_model_len=128, max_num_batched_tokens=48, max_num_seqs=8, block_size=8)
FINAL = RequestOutputKind.FINAL_ONLY


def tight_engine(preset: str, **options) -> LLMEngine:
    """A pool of one long request and a few blocks: requests must take turns (preemption)."""
    probe = LLMEngine(preset, **ENGINE)
    memory = probe.worker.plan.bytes_per_block * (sum(probe.worker.blocks_per_request) + 4)
    return LLMEngine(preset, kv_cache_memory=memory, **ENGINE, **options)


def workload(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    prefix = [(7 * j) % vocab for j in range(24)]
    out = []
    for i in range(10):
        prompt = ([*prefix] if i % 2 else []) + [(13 * i + j) % vocab for j in range(5 + 3 * i)]
        params = SamplingParams(
            max_tokens=6 + 5 * (i % 4),
            ignore_eos=i % 3 != 0,
            stop_token_ids=[(i * 31) % vocab, 5] if i % 4 == 1 else (),
            temperature=0.8 if i % 5 == 4 else 0.0,
            seed=100 + i if i % 5 == 4 else None,
            top_k=20 if i % 5 == 4 else 0,
            output_kind=FINAL,
        )
        out.append((prompt, params))
    return out


def serve(
    engine: LLMEngine,
    abort_at: dict[int, str],
    jobs: list[tuple[list[int], SamplingParams]] | None = None,
    later: dict[int, range] | None = None,
) -> dict[str, tuple]:
    """A serving loop: requests 0-4 of `jobs` (default `workload`) up front, the others after
    the steps `later` names (default: all after step 3), an abort after the steps in
    `abort_at`; returns every request's final tokens and finish reason."""
    jobs = jobs if jobs is not None else workload(min(engine.vocab_size, 256))
    later = later if later is not None else {3: range(5, len(jobs))}
    for i in range(5):
        engine.add_request(f"r{i}", *jobs[i])
    done: dict[str, tuple] = {}
    step, last_add = 0, max(later, default=0)
    while engine.has_unfinished_requests() or step <= last_add:
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = (tuple(c.token_ids), c.finish_reason, c.stop_reason)
        step += 1
        for i in later.get(step, ()):
            engine.add_request(f"r{i}", *jobs[i])
        if step in abort_at:
            engine.abort_request(abort_at[step])
    return done


@pytest.mark.parametrize("preset", ["tiny-llama", "gemma2-like", "hybrid-linear"])
def test_tokens_are_the_same_with_overlap_under_preemption_and_aborts(preset, spy):
    aborts = {6: "r1", 9: "r7"}
    plain = tight_engine(preset, async_scheduling=False)
    want = serve(plain, aborts)
    assert spy["launch"] == 0 and plain.scheduler.num_preemptions > 0
    overlapped = tight_engine(preset, async_scheduling=True)
    got = serve(overlapped, aborts)
    assert got.keys() == want.keys()
    for rid in got:
        if rid in aborts.values():  # when the abort lands depends on the timing: a prefix
            shorter, longer = sorted([got[rid][0], want[rid][0]], key=len)
            assert longer[: len(shorter)] == shorter
        else:
            assert got[rid] == want[rid], rid
    assert overlapped.scheduler.num_preemptions > 0
    assert spy["launch"] >= 10 and spy["from_device"] >= 10  # it did overlap
    assert {r for r, (_, reason, _) in got.items() if reason == "abort"} == {"r1", "r7"}
    assert overlapped.kv_cache_manager.usage == 0.0
    engine_steps, plain_steps = overlapped.stats.steps, plain.stats.steps
    assert engine_steps >= plain_steps  # a stopped request may cost one dropped step


def test_a_request_stopped_by_a_token_drops_the_step_in_flight(spy):
    engine = LLMEngine("tiny-llama", async_scheduling=True, **ENGINE)
    plain = LLMEngine("tiny-llama", async_scheduling=False, **ENGINE)
    prompt = list(range(3, 30))
    sampled = dict(max_tokens=12, ignore_eos=True, temperature=1.0, seed=7)  # tokens vary
    tokens = plain.generate([prompt], SamplingParams(**sampled))[0].outputs[0].token_ids
    k = next(k for k in range(2, 12) if tokens[k] not in tokens[:k])
    stop = tokens[k]  # token k stops it
    params = SamplingParams(**sampled, stop_token_ids=[stop])
    want = plain.generate([prompt], params)[0].outputs[0]
    got = engine.generate([prompt], params)[0].outputs[0]
    assert got.token_ids == want.token_ids == tokens[: k + 1]
    assert got.stop_reason == stop and got.finish_reason == "stop"
    assert spy["from_device"] > 0
    # the step in flight when the stop arrived computed one more token, which is dropped
    pending = engine._loop.pending
    assert pending is not None and [e.num_computed_before for e in pending.output.scheduled] == [
        len(prompt) + k  # the stop token's position: its id came from the device
    ]
    assert engine.kv_cache_manager.usage == 0.0
    assert engine.step() == [] and engine._loop.pending is not None  # an empty step now
    assert engine.stats.generated_tokens == k + 1


def test_max_tokens_is_never_scheduled_past(spy):
    engine = LLMEngine("tiny-llama", async_scheduling=True, **ENGINE)
    plain = LLMEngine("tiny-llama", async_scheduling=False, **ENGINE)
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    got = engine.generate([[1, 2, 3]], params)[0].outputs[0].token_ids
    assert got == plain.generate([[1, 2, 3]], params)[0].outputs[0].token_ids
    assert len(got) == 7 and engine.stats.steps == plain.stats.steps  # no wasted step


def test_each_step_returns_one_steps_outputs():
    engine = LLMEngine("tiny-llama", async_scheduling=True, **ENGINE)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    lengths = [len(out.outputs[0].token_ids) for out in engine.step()]
    assert lengths == [1]  # the first call already returns the first token
    assert [len(out.outputs[0].token_ids) for out in engine.step()] == [2]
    assert [o.finished for o in engine.step()] == [True]
    assert not engine.has_unfinished_requests()


def test_requests_that_read_their_logits_on_the_host_run_plain_steps(spy):
    engine = LLMEngine("tiny-llama", async_scheduling=True, **ENGINE)
    plain = LLMEngine("tiny-llama", async_scheduling=False, **ENGINE)
    params = [
        SamplingParams(max_tokens=5, logprobs=2, prompt_logprobs=1, ignore_eos=True),
        SamplingParams(max_tokens=5, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=5, ignore_eos=True),
    ]
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    got, want = engine.generate(prompts, params), plain.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert got[0].outputs[0].logprobs == want[0].outputs[0].logprobs
    assert spy["launch"] == 0  # while such a request is queued no step overlaps


def test_overlappable_names_what_reads_outputs_on_the_host():
    def request(**kw) -> Request:
        return Request("x", [1, 2], sampling_params=SamplingParams(**kw))

    assert overlappable(request())
    assert overlappable(request(temperature=0.7, top_p=0.9, top_k=5, seed=3))
    assert overlappable(request(stop=["a"], stop_token_ids=[3], max_tokens=4))
    for kw in [  # read their outputs with the token in flight appended, or log-probabilities
        dict(presence_penalty=0.5), dict(repetition_penalty=1.2), dict(min_tokens=2),
        dict(logit_bias={1: 2.0}), dict(allowed_token_ids=[1, 2]), dict(logprobs=0),
    ]:  # fmt: skip
        assert overlappable(request(**kw)), kw
    for kw in [dict(prompt_logprobs=1), dict(prompt_logits=True), dict(return_logits=True)]:
        assert not overlappable(request(**kw)), kw


def reading_jobs(engine: LLMEngine) -> list[tuple[list[int], SamplingParams]]:
    """`workload`'s prompts, each request's sampling reading its outputs: penalties (greedy and
    seeded), `min_tokens`, and a bad word of two tokens that the first request's own greedy
    output holds (the ban bites after the word's first token, which may be in flight); logit
    bias and allowed tokens beside them."""
    prompts = [prompt for prompt, _ in workload(min(engine.vocab_size, 256))]
    greedy = dict(ignore_eos=True, output_kind=FINAL)
    text = dict(allowed_token_ids=list(range(32, 127)))  # printable ASCII: words are text
    first = engine.generate(prompts[:1], SamplingParams(max_tokens=24, **greedy, **text))[0]
    ids = first.outputs[0].token_ids
    options = [
        dict(bad_words=["".join(map(chr, ids[4:6]))], **text),
        dict(repetition_penalty=2.0),
        dict(frequency_penalty=1.5, presence_penalty=0.5),
        dict(min_tokens=7, stop_token_ids=[ids[3]], ignore_eos=False),
        dict(logit_bias={ids[1]: 3.0}, repetition_penalty=1.5),
        dict(allowed_token_ids=list(range(30, 90)), presence_penalty=1.0),
        dict(repetition_penalty=1.8, temperature=0.9, seed=11, top_k=30),
        dict(frequency_penalty=0.7, temperature=1.0, seed=12),
        dict(min_tokens=4, presence_penalty=2.0),
        dict(repetition_penalty=1.3),
    ]
    return [
        (prompt, SamplingParams(**{**greedy, "max_tokens": 10 + 3 * (i % 4), **kw}))
        for i, (prompt, kw) in enumerate(zip(prompts, options, strict=True))
    ]


@pytest.mark.parametrize("preset", ["tiny-llama", "hybrid-linear"])
def test_requests_reading_their_outputs_overlap_with_the_tokens_of_plain_steps(preset, spy):
    """Penalties, bad words and `min_tokens` see the token in flight (`with_tokens_in_flight`):
    the tokens of every request equal plain steps', under preemption and aborts."""
    aborts = {7: "r2"}
    plain = tight_engine(preset, async_scheduling=False)
    jobs = reading_jobs(plain)
    want = serve(plain, aborts, jobs)
    assert spy["launch"] == 0 and plain.scheduler.num_preemptions > 0
    overlapped = tight_engine(preset, async_scheduling=True)
    got = serve(overlapped, aborts, jobs)
    assert got.keys() == want.keys()
    for rid in got:
        if rid == "r2":  # when the abort lands depends on the timing: a prefix
            shorter, longer = sorted([got[rid][0], want[rid][0]], key=len)
            assert longer[: len(shorter)] == shorter
        else:
            assert got[rid] == want[rid], rid
    assert spy["launch"] >= 10 and spy["from_device"] >= 10  # it did overlap
    assert overlapped.scheduler.num_preemptions > 0 and overlapped.kv_cache_manager.usage == 0.0


def test_async_scheduling_defaults_to_the_device():
    assert not LLMEngine("tiny-llama", **ENGINE)._loop.enabled  # CPU: off
    assert LLMEngine("tiny-llama", async_scheduling=True, **ENGINE)._loop.enabled


def test_tensor_parallelism_overlaps_only_when_asked():
    from unified_attn.engine.engine_config import EngineConfig
    from unified_attn.engine.step_loop import overlap_steps

    cuda = torch.device("cuda")
    assert overlap_steps(EngineConfig(), cuda)
    assert not overlap_steps(EngineConfig(tensor_parallel_size=2), cuda)
    assert overlap_steps(EngineConfig(tensor_parallel_size=2, async_scheduling=True), cuda)
    assert not overlap_steps(EngineConfig(), torch.device("cpu"))


@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_a_bad_async_scheduling_value_is_refused_and_names_the_choices(value):
    with pytest.raises(ValueError, match=r"async_scheduling must be True, False or None"):
        LLMEngine("tiny-llama", async_scheduling=value, **ENGINE)
    assert LLMEngine("tiny-llama", **ENGINE).generate([[1, 2]], SamplingParams(max_tokens=2))


@pytest.mark.parametrize("preset", ["tiny-llama", "gemma2-like"])
def test_log_probabilities_of_overlapped_steps_equal_plain_steps(preset, spy):
    """Sample log-probabilities (top 2, 0 or 20, or none) of greedy, seeded and penalized
    requests come back with the ids, equal to plain steps', under preemption."""
    plain = tight_engine(preset, async_scheduling=False)
    jobs = [
        (prompt, attrs.evolve(params, logprobs=[2, 0, None, 20][i % 4]))
        for i, (prompt, params) in enumerate(reading_jobs(plain))
    ]
    want = serve_outputs(plain, jobs)
    assert spy["launch"] == 0 and plain.scheduler.num_preemptions > 0
    overlapped = tight_engine(preset, async_scheduling=True)
    got = serve_outputs(overlapped, jobs)
    assert spy["launch"] >= 10 and overlapped.scheduler.num_preemptions > 0
    assert got.keys() == want.keys()
    for rid, completion in got.items():
        assert completion.token_ids == want[rid].token_ids, rid
        assert (completion.logprobs is None) == (want[rid].logprobs is None), rid
        if completion.logprobs is None:
            continue
        for token, a, b in zip(completion.token_ids, completion.logprobs, want[rid].logprobs,
                               strict=True):  # fmt: skip
            # the batches differ (preemption, a dropped step): float32 logits differ in ulps
            assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-5)
            assert len(a) == len(b)
            assert sorted(v.logprob for v in a.values()) == pytest.approx(
                sorted(v.logprob for v in b.values()), abs=1e-5
            )
    logprobs = [lp for c in got.values() for lp in c.logprobs or ()]
    assert len(logprobs) > 50 and any(len(lp) >= 20 for lp in logprobs)


def serve_outputs(engine: LLMEngine, jobs: list[tuple[list[int], SamplingParams]]) -> dict:
    """Every request of `jobs` at once; each one's final completion (tokens, logprobs...)."""
    for i, (prompt, params) in enumerate(jobs):
        engine.add_request(f"r{i}", prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    return done


def test_the_token_in_flight_is_appended_only_where_sampling_reads_outputs():
    from unified_attn.runner.logits_processing import reads_outputs
    from unified_attn.runner.overlap import DeviceTokens, with_tokens_in_flight
    from unified_attn.runner.sampler import ExtendedRequest

    def request(rid: str, placeholders: int, **kw) -> Request:
        r = Request(rid, [1, 2], sampling_params=SamplingParams(**kw))
        r.append_output_token_ids([5, 6])
        r.num_output_placeholders = placeholders
        return r

    ids = torch.tensor([11, 12, 13])
    plain = [request(r, 0) for r in "abc"]
    tokens = DeviceTokens.of_step(ids, plain, to_host=False, readers=any(map(reads_outputs, plain)))
    assert tokens.host is None  # no request of the step reads its outputs: no copy
    with pytest.raises(RuntimeError, match="did not copy its ids to the host"):
        tokens.on_host()
    readers = [request("a", 1, min_tokens=3), request("b", 1), request("c", 0, presence_penalty=1)]
    tokens = DeviceTokens.of_step(ids, readers, to_host=False, readers=True)
    assert tokens.on_host() == {"a": 11, "b": 12, "c": 13}
    seen = with_tokens_in_flight(readers, [r for r in readers if reads_outputs(r)], tokens)
    assert isinstance(seen[0], ExtendedRequest) and seen[0].output_token_ids == [5, 6, 11]
    assert seen[1] is readers[1] and seen[2] is readers[2]  # reads nothing / nothing in flight
    no_wait = with_tokens_in_flight(readers[1:], readers[2:], DeviceTokens.none())
    assert no_wait == readers[1:]  # its one reader has nothing in flight: no wait
    x = request("x", 2, repetition_penalty=1.5)
    with pytest.raises(RuntimeError, match="'x' has 2 tokens in flight, expected 1"):
        with_tokens_in_flight([x], [x], tokens)
