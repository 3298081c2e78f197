"""Overlapped steps on a GPU (`engine/step_loop.py`): the launch of a step never waits for the
device (torch's sync debug mode turns any synchronising call into an error; waiting on the
previous step's copy event, which requests reading their outputs do, is not one), and tokens
equal plain steps' with CUDA graphs, under preemption and aborts, also for penalties, bad words,
`min_tokens` and log-probabilities."""

from __future__ import annotations

import attrs
import pytest
import torch

from tests.runner.test_async_scheduling import reading_jobs, serve, tight_engine
from unified_attn.runner.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = dict(device="cuda", dtype="float32")


@pytest.fixture
def no_sync_in_launch(monkeypatch):
    """Every overlapped launch runs under `torch.cuda.set_sync_debug_mode("error")`."""
    launch = ModelRunner.launch
    counts = {"launch": 0}

    def strict_launch(self, output):
        counts["launch"] += bool(output.scheduled)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(self, output)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(ModelRunner, "launch", strict_launch)
    return counts


@pytest.mark.parametrize("preset", ["tiny-llama", "gemma2-like", "hybrid-linear"])
def test_overlapped_steps_never_wait_and_keep_the_tokens(preset, no_sync_in_launch):
    aborts = {6: "r1", 9: "r7"}
    want = serve(tight_engine(preset, async_scheduling=False, **CUDA), aborts)
    engine = tight_engine(preset, async_scheduling=True, **CUDA)
    got = serve(engine, aborts)
    assert no_sync_in_launch["launch"] >= 10
    if preset != "hybrid-linear":  # its linear-state layers run decode eagerly
        assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0
    for rid in got:
        if rid not in aborts.values():
            assert got[rid] == want[rid], rid
    assert engine.kv_cache_manager.usage == 0.0


@pytest.mark.parametrize("preset", ["tiny-llama", "gemma2-like"])
def test_steps_reading_their_outputs_overlap_without_waiting(preset, no_sync_in_launch):
    aborts = {7: "r2"}
    plain = tight_engine(preset, async_scheduling=False, **CUDA)
    jobs = [(prompt, attrs.evolve(params, logprobs=[None, 2][i % 2]))
            for i, (prompt, params) in enumerate(reading_jobs(plain))]  # fmt: skip
    want = serve(plain, aborts, jobs)
    engine = tight_engine(preset, async_scheduling=True, **CUDA)
    got = serve(engine, aborts, jobs)
    assert no_sync_in_launch["launch"] >= 10
    assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0
    for rid in got:
        if rid not in aborts.values():
            assert got[rid][0] == want[rid][0], rid
    assert engine.kv_cache_manager.usage == 0.0
