"""The engine and Python's garbage collector (`runner/gc_heap.py`, as vLLM's EngineCore does):
the objects alive once an engine is built are frozen, so the serving loop's collections skip
them, and `shutdown()` unfreezes them; `freeze_gc=False` or `UNIFIED_ATTN_FREEZE_GC=0` keeps the
collector as it is; CUDA graph capture runs with no collection."""

from __future__ import annotations

import gc

import pytest

from unified_attn import LLMEngine, SamplingParams
from unified_attn.runner.gc_heap import gc_paused


@pytest.fixture
def collector(monkeypatch):
    """The session's switch (tests/conftest.py) lifted; the collector restored afterwards."""
    monkeypatch.delenv("UNIFIED_ATTN_FREEZE_GC", raising=False)
    yield
    gc.unfreeze()


def test_a_built_engine_freezes_the_startup_heap_and_shutdown_unfreezes_it(collector):
    gc.unfreeze()
    engine = LLMEngine("tiny-llama")
    assert gc.get_freeze_count() > 10_000  # the modules, the model, the managers
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].output_token_ids) == 4  # serves as before
    engine.shutdown()
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("how", ["option", "environment"])
def test_freezing_can_be_turned_off(collector, monkeypatch, how):
    gc.unfreeze()
    if how == "option":
        LLMEngine("tiny-llama", freeze_gc=False)
    else:
        monkeypatch.setenv("UNIFIED_ATTN_FREEZE_GC", "no")
        assert not LLMEngine("tiny-llama").config.freeze_gc
    assert gc.get_freeze_count() == 0


def test_bad_values_are_refused_by_name(collector, monkeypatch):
    with pytest.raises(ValueError, match="freeze_gc must be True or False, got 'yes'"):
        LLMEngine("tiny-llama", freeze_gc="yes")
    monkeypatch.setenv("UNIFIED_ATTN_FREEZE_GC", "maybe")
    with pytest.raises(ValueError, match="UNIFIED_ATTN_FREEZE_GC='maybe' is not a switch"):
        LLMEngine("tiny-llama")


def test_no_collection_runs_while_paused_and_the_collector_is_restored():
    runs = []

    def count(phase, info):
        if phase == "start":
            runs.append(info["generation"])

    gc.callbacks.append(count)
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            with gc_paused():
                assert not gc.isenabled()
                runs.clear()
                for _ in range(50_000):  # cyclic garbage that would trigger collections
                    a: list = []
                    a.append(a)
                assert runs == []
            assert gc.isenabled() == enabled and gc.get_freeze_count() == 0
    finally:
        gc.callbacks.remove(count)
        gc.enable()


def test_the_command_refuses_a_bad_switch_in_one_line(collector, monkeypatch, capsys):
    from unified_attn.cli import main as cli_main

    monkeypatch.setenv("UNIFIED_ATTN_FREEZE_GC", "maybe")
    assert cli_main(["run", "--max-tokens", "2", "--num-requests", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "unified-attn run: error: UNIFIED_ATTN_FREEZE_GC='maybe' is not a switch"
    )


def test_freeze_if_configured_freezes_only_when_asked(collector):
    """What rank 0's engine and every other tensor-parallel rank (`serve_rank`) run once
    built."""
    from unified_attn.runner.gc_heap import freeze_if_configured

    gc.unfreeze()
    assert freeze_if_configured(False) is False and gc.get_freeze_count() == 0
    assert freeze_if_configured(True) is True and gc.get_freeze_count() > 0
