"""`LLMEngine.subscribe_kv_events`: after every step a subscriber gets that step's events (never
an empty batch), and replaying them mirrors the engine's prefix cache."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tests.managers.test_kv_events import cached_set, check_chain, replay
from unified_attn import LLMEngine, SamplingParams
from unified_attn.managers.events import BlockRemoved, BlockStored, KVCacheEvent


def prompts(n: int = 3) -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(256) for _ in range(40)]
    return [[*shared, *(rng.randrange(256) for _ in range(10 + 7 * i))] for i in range(n)]


def test_subscribers_get_each_steps_events_and_can_mirror_the_cache():
    # A small cache: later requests evict the blocks of earlier ones.
    engine = LLMEngine("tiny-hybrid", kv_cache_memory="512KiB", max_model_len=128)
    batches: list[list[KVCacheEvent]] = []
    engine.subscribe_kv_events(batches.append)
    mirror: Counter[tuple[bytes, int]] = Counter()
    for prompt in prompts(6):
        engine.add_request(None, prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    while engine.has_unfinished_requests():
        seen = len(batches)
        engine.step()
        engine._publish_kv_events()  # a no-op once `_step` publishes itself
        for batch in batches[seen:]:
            assert batch, "subscribers never get an empty batch"
            replay(mirror, batch)
        assert +mirror == cached_set(engine.kv_cache_manager.block_pool)
    events = [e for batch in batches for e in batch]
    assert any(isinstance(e, BlockRemoved) for e in events)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert {e.group_id for e in stored} == set(range(engine.kv_cache_manager.num_groups))
    for event in stored:
        check_chain(event, engine.kv_cache_manager.hash_block_size)


def test_imports_are_published_at_once():
    a = LLMEngine("tiny-llama", kv_cache_memory="1MiB", max_model_len=256)
    prompt = prompts(1)[0]
    a.generate([prompt], SamplingParams(max_tokens=1))
    b = LLMEngine("tiny-llama", kv_cache_memory="1MiB", max_model_len=256)
    batches: list[list[KVCacheEvent]] = []
    b.subscribe_kv_events(batches.append)
    b.import_cached_blocks(a.export_cached_blocks(a.prompt_block_hashes(prompt), prompt))
    (batch,) = batches
    assert [e.block_hashes[0] for e in batch] == b.prompt_block_hashes(prompt)
    for event in batch:
        check_chain(event, b.kv_cache_manager.hash_block_size)


def test_the_engine_takes_the_eviction_switch():
    engine = LLMEngine("tiny-hybrid", kv_cache_eviction="window_aware")
    assert engine.kv_cache_manager.block_pool.eviction == "window_aware"
    assert LLMEngine("tiny-hybrid").kv_cache_manager.block_pool.eviction == "lru"
    with pytest.raises(ValueError, match="kv_cache_eviction='fifo' is not a policy; pick one of"):
        LLMEngine("tiny-hybrid", kv_cache_eviction="fifo")
