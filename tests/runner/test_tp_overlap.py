"""Overlapped steps with tensor parallelism (`engine/step_loop.py`): every rank launches the
steps rank 0 launches and samples the same ids on its own device, which feed its next step.

In one process first: a follower runner stands in for rank 1 (`Follower`, in place of the
engine's `TensorParallelGroup`): each step's message goes through the codec to a `Replica` and
`tp_group.run_step`, as it would on another rank, and the follower's sampled ids must equal
rank 0's, bit for bit, after every step, with plain steps that sample randomly before and
between the overlapped ones (the follower's generators must stay in step with rank 0's:
`overlap.draw_along`). Then two real ranks (gloo, spawned), whose tokens must equal one device's
with plain and with overlapped steps.

Ranks other than 0 cannot fall back silently: a rank that runs a launched step plainly has no
ids for the next step's placeholders and raises (tested below); a rank whose generators drifted
would feed other tokens than rank 0's and the outputs would differ from one device's.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from tests.runner.test_async_scheduling import ENGINE, FINAL, workload
from tests.runner.test_async_scheduling import serve as serve_jobs
from unified_attn import LLMEngine, SamplingParams
from unified_attn.distributed.tp_codec import decode, encode
from unified_attn.distributed.tp_group import run_step
from unified_attn.distributed.tp_messages import Mirror, Replica
from unified_attn.runner import model_runner
from unified_attn.runner.model_runner import ModelRunner
from unified_attn.runner.scheduler import SchedulerOutput

ABORTS = {6: "r1", 9: "r7", 33: "r12"}


def tight_memory(preset: str, **options) -> int:
    """A pool of one long request and a few blocks: requests must take turns (preemption)."""
    probe = LLMEngine(preset, **ENGINE, **options)
    return probe.worker.plan.bytes_per_block * (sum(probe.worker.blocks_per_request) + 4)


def mixed_workload(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    """tests/runner/test_async_scheduling.py's requests (greedy and seeded, stop tokens,
    max_tokens, EOS), a seeded one that stops on a token (r11) and requests that sample with
    the engine's generator (r2, r5, r10); r6 and r8 have penalties (r8 also `min_tokens`);
    r3 and r13 read their prompt log-probabilities, so steps run plainly, and sample randomly, while
    they are queued: plain steps first, then overlapped ones, plain ones again, overlapped."""
    jobs = workload(vocab)
    unseeded = dict(temperature=1.0, ignore_eos=True, output_kind=FINAL)
    head = [(5 * j + 1) % vocab for j in range(9)]
    jobs[2] = (jobs[2][0], SamplingParams(max_tokens=30, **unseeded))
    jobs[3] = ([3, 4, 5, 6, 7], SamplingParams(max_tokens=3, logprobs=1, prompt_logprobs=1,
                                                **unseeded))  # fmt: skip
    jobs[5] = (jobs[5][0], SamplingParams(max_tokens=16, top_p=0.9, **unseeded))
    # sampling that reads the outputs (with the token in flight, on every rank)
    jobs[6] = (jobs[6][0], SamplingParams(max_tokens=14, repetition_penalty=1.6,
                                          ignore_eos=True, output_kind=FINAL))  # fmt: skip
    jobs[8] = (jobs[8][0], SamplingParams(max_tokens=12, presence_penalty=1.2, min_tokens=5,
                                          seed=21, **unseeded))  # fmt: skip
    jobs.append((head, SamplingParams(max_tokens=30, **unseeded)))
    # stops on its 15th token (every preset here), a step before its max_tokens
    stops = tuple(range(3, vocab, 17))
    jobs.append((head[:4], SamplingParams(max_tokens=16, seed=12, stop_token_ids=stops,
                                          **unseeded)))  # fmt: skip
    jobs.append((head[3:], SamplingParams(max_tokens=40, ignore_eos=True, output_kind=FINAL)))
    jobs.append((head[2:], SamplingParams(max_tokens=3, prompt_logprobs=0, **unseeded)))
    return jobs


def serve(engine: LLMEngine) -> dict[str, tuple]:
    """Half the requests up front (r3 reads its prompt log-probabilities), the rest after step
    3 (r13 after step 12: plain steps again), aborts after the steps in `ABORTS`; every request's
    final tokens and finish reason."""
    jobs = mixed_workload(min(engine.vocab_size, 256))
    return serve_jobs(engine, ABORTS, jobs, later={3: range(5, 13), 12: range(13, 14)})


# ---- one process: a follower runner as rank 1 --------------------------------------------------


class Follower:
    """Stands in for `TensorParallelGroup`: runs every step on `runner` as rank 1 would, from
    the bytes of its message, after checking that the two runners hold the same ids and that
    each entry reads its input from the device on both or on neither."""

    closed = False

    def __init__(self, leader: LLMEngine, runner: ModelRunner, plain: bool = False) -> None:
        self.leader, self.runner, self.plain = leader, runner, plain
        self.mirror, self.replica = Mirror(), Replica()
        self.steps = {"launched": 0, "plain": 0, "compared": 0, "mismatched": 0}

    def broadcast(self, output: SchedulerOutput, launch: bool = False) -> None:
        self.compare()  # both hold the previous step's ids now
        message = decode(encode(self.mirror.message(output, launch)))
        assert message.launch == launch
        rebuilt = self.replica.output(message)
        for ours, theirs in zip(output.scheduled, rebuilt.scheduled, strict=True):
            mine, its = ours.request, theirs.request
            assert its.all_token_ids == mine.all_token_ids  # the token in flight on neither
            assert theirs.num_computed_before == ours.num_computed_before
        run_step(self.runner, rebuilt, launch and not self.plain)
        self.steps["launched" if launch else "plain"] += 1

    def compare(self) -> None:
        if self.plain:
            return
        ours, theirs = self.leader.runner.device_tokens, self.runner.device_tokens
        assert theirs.rows == ours.rows
        if ours.rows:
            self.steps["compared"] += 1
            self.steps["mismatched"] += not torch.equal(theirs.ids, ours.ids)

    def fail(self, error: BaseException) -> None:
        self.closed = True
        raise error

    def shutdown(self) -> None:
        self.closed = True


def with_follower(preset: str, plain: bool = False) -> tuple[LLMEngine, Follower]:
    memory = tight_memory(preset)
    leader = LLMEngine(preset, kv_cache_memory=memory, async_scheduling=True, **ENGINE)
    other = LLMEngine(preset, kv_cache_memory=memory, **ENGINE)  # the same weights and blocks
    follower = Follower(leader, other.runner, plain)
    leader._tp = follower  # type: ignore[assignment]
    return leader, follower


@pytest.mark.parametrize("preset", ["tiny-llama", "hybrid-linear"])
def test_every_rank_samples_rank_0s_ids_across_plain_and_overlapped_steps(preset, spy):
    leader, follower = with_follower(preset)
    got = serve(leader)
    follower.compare()
    steps = follower.steps
    assert steps["launched"] >= 10 and steps["plain"] >= 4, steps
    assert steps["compared"] >= 10 and steps["mismatched"] == 0, steps
    assert spy["launch"] >= 10 and spy["from_device"] >= 20  # both runners fed from the device
    assert leader.scheduler.num_preemptions > 0 and got["r11"][1] == "stop"
    # the leader's tokens are one device's overlapped tokens (the follower changes nothing)
    alone = LLMEngine(preset, kv_cache_memory=tight_memory(preset), async_scheduling=True,
                      **ENGINE)  # fmt: skip
    assert got == serve(alone)


def test_without_the_plain_steps_draws_the_ranks_would_sample_other_ids(monkeypatch):
    """What `draw_along` prevents: rank 0's generators advance in plain steps that sample
    randomly; a rank that skips those draws samples other ids once steps overlap."""
    monkeypatch.setattr(model_runner, "draw_along", lambda *args: None)
    leader, follower = with_follower("tiny-llama")
    serve(leader)
    assert follower.steps["mismatched"] > 0


def test_a_rank_that_runs_a_launched_step_plainly_cannot_feed_the_next_one():
    """The next step's placeholders find no ids on that rank: it raises (on a real rank, rank
    0's next collective then fails and names it), never feeding stale tokens."""
    leader, _ = with_follower("tiny-llama", plain=True)
    with pytest.raises(RuntimeError, match="wait for a token the last launched step did not"):
        serve(leader)


# ---- two ranks ---------------------------------------------------------------------------------


def run_two_ranks(memory: int, **options) -> tuple[dict[str, tuple], LLMEngine]:
    engine = LLMEngine("tiny-llama", tensor_parallel_size=2, kv_cache_memory=memory, **ENGINE,
                       **options)  # fmt: skip
    try:
        return serve(engine), engine
    finally:
        engine.shutdown()


def test_two_ranks_overlapped_give_the_tokens_of_one_device(spy):
    """Preemption (a tight pool), aborts, stop tokens, max_tokens; greedy, seeded and unseeded
    sampling, with plain steps that sample randomly before and between overlapped ones.
    Overlapped on two ranks: the tokens of overlapped steps on one device, all of them (the
    aborts land at the same steps); greedy and seeded ones also those of plain steps, on one
    device and on two ranks."""
    memory = tight_memory("tiny-llama")
    one = LLMEngine("tiny-llama", kv_cache_memory=memory, **ENGINE)
    plain_one = serve(one)
    overlapped_one = serve(LLMEngine("tiny-llama", kv_cache_memory=memory,
                                     async_scheduling=True, **ENGINE))  # fmt: skip
    launches = spy["launch"]
    # a rank holds one of the 2 KV heads: half the bytes give one device's blocks
    plain_two, engine = run_two_ranks(memory // 2)
    assert engine.rank_num_blocks == [one.worker.num_blocks] * 2
    assert spy["launch"] == launches and plain_two == plain_one
    overlapped_two, engine = run_two_ranks(memory // 2, async_scheduling=True)
    assert spy["launch"] - launches >= 10 and spy["from_device"] >= 20  # rank 0 overlapped
    assert engine.scheduler.num_preemptions > 0 and engine.kv_cache_manager.usage == 0.0
    assert overlapped_two == overlapped_one
    jobs = dict(zip((f"r{i}" for i in range(14)), mixed_workload(256), strict=True))
    compared = 0
    for rid, (tokens, reason, stop) in overlapped_two.items():
        params = jobs[rid][1]
        if reason != "abort" and (params.greedy or params.seed is not None):
            assert (tokens, reason, stop) == plain_one[rid], rid
            compared += 1
    assert compared >= 6 and overlapped_two["r11"][1] == "stop"
    assert {r for r, (_, reason, _) in overlapped_two.items() if reason == "abort"} == set(
        ABORTS.values()
    )


def test_a_killed_rank_is_reported_while_steps_overlap():
    """Rank 0's next broadcast fails: the engine names the rank, drops the step in flight (it
    will never arrive), stops the ranks and refuses further steps."""
    engine = LLMEngine("tiny-llama", tensor_parallel_size=2, async_scheduling=True)
    try:
        engine.add_request(None, [5, 6, 7] * 8, SamplingParams(max_tokens=40, ignore_eos=True))
        engine.step()
        assert engine._loop.pending is not None
        os.kill(engine._tp.pids[0], signal.SIGKILL)
        with pytest.raises(RuntimeError, match="tensor parallelism: rank 1 died"):
            while engine.has_unfinished_requests():
                engine.step()
        assert engine._loop.pending is None
        with pytest.raises(RuntimeError, match="was shut down"):
            engine.step()
    finally:
        engine.shutdown()
