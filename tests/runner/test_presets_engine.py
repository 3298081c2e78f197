"""Every preset end to end: chunked prefill, prefix caching and preemption never change the
tokens; window layers keep a bounded number of blocks and hit right-aligned prefixes."""

import random

import pytest

from unified_attn import LLMEngine, SamplingParams
from unified_attn.models import PRESETS

PARAMS = SamplingParams(max_tokens=20, ignore_eos=True)


def prompts(seed=0, n=4, shared=70):
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(shared)]
    return [prefix + [rng.randrange(256) for _ in range(rng.randint(5, 40))] for _ in range(n)]


def tokens(engine, batch, params=PARAMS):
    return [o.output_token_ids for o in engine.generate(batch, params)]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_scheduling_never_changes_the_tokens(preset):
    batch = prompts()
    baseline = tokens(
        LLMEngine(preset, enable_prefix_caching=False, max_num_batched_tokens=4096), batch
    )
    chunked = LLMEngine(preset, max_num_batched_tokens=16)
    assert tokens(chunked, batch) == baseline
    tight = LLMEngine(preset, kv_cache_memory=_tight_memory(preset), max_model_len=128,
                      max_num_batched_tokens=32)  # fmt: skip
    assert tokens(tight, batch) == baseline
    assert tight.scheduler.num_preemptions > 0


def _tight_memory(preset):
    """Room for one worst-case request and two spare blocks: four requests must take turns."""
    probe = LLMEngine(preset, max_model_len=128, max_num_batched_tokens=32)
    return probe.worker.plan.bytes_per_block * (sum(probe.worker.blocks_per_request) + 2)


def test_window_model_holds_a_constant_number_of_blocks_per_request():
    engine = LLMEngine("mistral-like", max_num_batched_tokens=64)  # window 64
    params = SamplingParams(max_tokens=4 * 64, ignore_eos=True)
    rid = engine.add_request(None, prompts(n=1)[0], params)
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        blocks = engine.kv_cache_manager.get_blocks(rid).blocks[0]
        if blocks:  # still running
            held.append(sum(1 for b in blocks if not b.is_null))
    cap = engine.kv_cache_manager.max_blocks_per_request()[0]
    assert max(held) <= cap
    assert max(held[-100:]) == min(held[-100:]) + 1 or max(held[-100:]) == min(held[-100:])


@pytest.mark.parametrize("preset", ["mistral-like", "gpt-oss-like", "streaming-llm"])
def test_window_prefix_hits_are_right_aligned_and_change_nothing(preset):
    rng = random.Random(1)
    shared = [rng.randrange(256) for _ in range(200)]  # longer than every window here
    first, second = [*shared, 1, 2, 3], [*shared, 4, 5, 6, 7]
    cold = LLMEngine(preset, enable_prefix_caching=False)
    expected = tokens(cold, [second])
    warm = LLMEngine(preset)
    tokens(warm, [first])
    assert tokens(warm, [second]) == expected
    stats = warm.kv_cache_manager.group_stats()
    assert all(g["hit_blocks"] > 0 for g in stats)
    hit = warm.kv_cache_manager.prefix_cache_stats.hits
    assert hit >= 192  # the whole shared prefix, block aligned


def test_state_layers_leave_prefix_checkpoints_that_later_requests_hit():
    rng = random.Random(2)
    shared = [rng.randrange(256) for _ in range(100)]
    cold = LLMEngine("hybrid-linear", enable_prefix_caching=False)
    expected = tokens(cold, [[*shared, 9, 9]])
    warm = LLMEngine("hybrid-linear")
    tokens(warm, [[*shared, 1]])  # its prefill stops at 96, a checkpoint boundary
    assert tokens(warm, [[*shared, 9, 9]]) == expected
    assert warm.kv_cache_manager.prefix_cache_stats.hits >= 96
