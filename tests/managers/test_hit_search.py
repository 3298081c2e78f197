"""The hit-search fast paths: the pool's prefix scans, the window search against a per-block
reference, the contract the hybrid coordinator relies on, and its one-pass fixed point."""

from itertools import takewhile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.managers.helpers import FULL, admit, make_manager, make_request
from unified_attn.managers import (
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    SlidingWindowManager,
    StateManager,
    StreamingSinkManager,
)
from unified_attn.managers.block_pool import BlockPool
from unified_attn.managers.sliding_window import find_window_run

HASHES = [bytes([i + 1]) * 32 for i in range(24)]


def cached_pool(pattern, group_id=0, duplicates=False):
    """One block per position cached under HASHES (in two blocks with `duplicates`), then
    the positions marked False evicted; returns the pool and each position's first block."""
    pool = BlockPool(2 * len(pattern) + 2)
    blocks = pool.get_new_blocks(len(pattern))
    pool.cache_full_blocks(blocks, HASHES, 0, len(pattern), group_id)
    twins = pool.get_new_blocks(len(pattern)) if duplicates else []
    pool.cache_full_blocks(twins, HASHES, 0, len(twins), group_id)
    pool.free_blocks(twins + list(reversed(blocks)))
    evicted = [i for i, keep in enumerate(pattern) if not keep]
    pool.evict_blocks(b.block_id for i in evicted for b in (blocks + twins)[i :: len(pattern)])
    return pool, [b if keep else None for b, keep in zip(blocks, pattern, strict=True)]


# ---- the pool's scans --------------------------------------------------------------------------


@pytest.mark.parametrize("duplicates", [False, True])
def test_cached_prefix_matches_one_lookup_per_hash(duplicates):
    pattern = [True, True, True, False, True]
    pool, _ = cached_pool(pattern, group_id=2, duplicates=duplicates)
    one_by_one = [pool.get_cached_block(h, [2]) for h in HASHES[:5]]
    expected = [found[0] for found in takewhile(lambda f: f is not None, one_by_one)]
    assert pool.get_cached_prefix(HASHES[:5], 2) == expected
    assert len(expected) == 3
    assert pool.get_cached_prefix(HASHES[:5], 0) == []  # another group's key
    assert pool.count_uncached_prefix(HASHES[3:5], 2) == 1
    assert pool.count_uncached_prefix(reversed(HASHES[:4]), 2) == 1
    assert pool.count_uncached_prefix(HASHES[:5], 1) == 5


def test_cached_prefix_follows_duplicates_as_they_come_and_go():
    pool = BlockPool(6)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], HASHES, 0, 1, 0)
    pool.cache_full_blocks([b], HASHES, 0, 1, 0)  # a duplicate of a
    assert pool.get_cached_prefix(HASHES[:1], 0) == [a]
    pool.evict_blocks([a.block_id])  # back to a single block
    assert pool.get_cached_prefix(HASHES[:1], 0) == [b]
    c = pool.get_new_blocks(1)[0]
    pool.cache_full_blocks([c], HASHES, 0, 1, 0)
    assert pool.get_cached_prefix(HASHES[:1], 0) == [b] == pool.get_cached_block(HASHES[0], [0])


# ---- the window search against a per-block reference -------------------------------------------


def reference_window_hit(manager, cached, max_length, alignment, num_leading):
    """The window rule checked end by end, right to left, one block at a time."""
    bs, null = manager.block_size, manager.null_block
    num_blocks = max(max_length // bs, 0)

    def prefix_hit(prefix):
        hit = len(prefix) * bs // alignment * alignment
        return prefix[: hit // bs], hit

    leading = list(takewhile(lambda b: b is not None, cached[: min(num_leading, num_blocks)]))
    if len(leading) < num_leading or num_blocks == 0:
        return prefix_hit(leading)
    need = manager.blocks_needed_for_hit()
    if need == 0:
        end = num_blocks * bs // alignment * alignment // bs
        return leading + [null] * (end - num_leading), end * bs
    for end in range(num_blocks, 0, -1):
        start = min(max(end - need, num_leading), end - 1)
        if end * bs % alignment == 0 and all(b is not None for b in cached[start:end]):
            return leading[:start] + [null] * (start - num_leading) + cached[start:end], end * bs
    rest = takewhile(lambda b: b is not None, cached[num_leading:num_blocks])
    return prefix_hit(leading + list(rest))


def window_manager(pool, block_size, window, num_sink_tokens):
    common = dict(
        block_size=block_size, block_pool=pool, group_id=0, enable_caching=True, max_model_len=99
    )
    if num_sink_tokens:
        config = StreamingSinkManager.Config(num_sink_tokens, window)
        return StreamingSinkManager(config, **common)
    return SlidingWindowManager(SlidingWindowManager.Config(sliding_window=window), **common)


@settings(max_examples=400, deadline=None)
@given(
    pattern=st.lists(st.booleans(), max_size=24),
    block_size=st.sampled_from([1, 2, 4]),
    window=st.integers(1, 40),
    num_sink_tokens=st.sampled_from([0, 0, 1, 3, 6]),
    alignment_blocks=st.sampled_from([1, 1, 2, 3]),
    duplicates=st.booleans(),
    data=st.data(),
)
def test_window_search_matches_the_per_block_reference(
    pattern, block_size, window, num_sink_tokens, alignment_blocks, duplicates, data
):
    pool, cached = cached_pool(pattern, duplicates=duplicates)
    m = window_manager(pool, block_size, window, num_sink_tokens)
    alignment = alignment_blocks * block_size
    max_length = data.draw(st.integers(0, len(pattern) * block_size))
    num_leading = m.first_freeable_block()
    expected = reference_window_hit(m, cached, max_length, alignment, num_leading)
    assert find_window_run(m, HASHES, max_length, alignment, num_leading) == expected


# ---- the contract the hybrid coordinator relies on ---------------------------------------------


def built_in_manager(kind, pool, block_size):
    common = dict(
        block_size=block_size, block_pool=pool, group_id=0, enable_caching=True, max_model_len=99
    )
    configs = {
        "full": (FullAttentionManager, FullAttentionManager.Config()),
        "sliding": (SlidingWindowManager, SlidingWindowManager.Config(sliding_window=5)),
        "sink": (StreamingSinkManager, StreamingSinkManager.Config(2, 5)),
        "chunked": (ChunkedLocalAttentionManager, ChunkedLocalAttentionManager.Config(6)),
        "state": (StateManager, StateManager.Config(mamba_cache_mode="align")),
    }
    cls, config = configs[kind]
    return cls(config, **common)


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(["full", "sliding", "sink", "chunked", "state"]),
    pattern=st.lists(st.booleans(), max_size=16),
    alignment_blocks=st.sampled_from([1, 2]),
    data=st.data(),
)
def test_a_search_at_its_own_result_returns_it_again(kind, pattern, alignment_blocks, data):
    pool, _ = cached_pool(pattern)
    m = built_in_manager(kind, pool, block_size=2)
    alignment = 2 * alignment_blocks
    max_length = data.draw(st.integers(0, 2 * len(pattern))) // alignment * alignment
    blocks, hit = m.find_longest_cache_hit(HASHES[: len(pattern)], max_length, alignment)
    assert hit <= max_length
    assert m.find_longest_cache_hit(HASHES[: len(pattern)], hit, alignment) == (blocks, hit)


# ---- the hybrid coordinator ----------------------------------------------------------------------


def swa(window):
    return (SlidingWindowManager, SlidingWindowManager.Config(sliding_window=window))


def count_searches(manager):
    """Wrap the manager's hit search; returns the list of `max_length`s it is asked for."""
    asked = []
    search = manager.find_longest_cache_hit

    def counted(block_hashes, max_length, alignment):
        asked.append(max_length)
        return search(block_hashes, max_length, alignment)

    manager.find_longest_cache_hit = counted
    return asked


def test_a_window_group_that_shrinks_the_hit_is_not_asked_again():
    m = make_manager(num_blocks=30, block_size=4, groups=[FULL, swa(8)], max_model_len=64)
    a = make_request(m, "A", range(24))
    admit(m, a)
    window_blocks = m.get_block_ids(a)[1]
    m.free(a)
    m.evict_blocks([window_blocks[4]])  # the window group lost tokens [16, 20)
    asked = [count_searches(g) for g in m.managers]
    hits, hit = m.get_computed_blocks(make_request(m, "B", [*range(24), 7]))
    assert hit == 16 and [len(g) for g in hits.blocks] == [4, 4]
    assert asked == [[24], [24]]


def test_an_earlier_window_group_is_asked_again_when_a_later_one_cuts_below_it():
    m = make_manager(num_blocks=40, block_size=4, groups=[FULL, swa(5), swa(9)], max_model_len=64)
    a = make_request(m, "A", range(24))
    admit(m, a)
    wide_blocks = m.get_block_ids(a)[2]
    m.free(a)
    m.evict_blocks([wide_blocks[5]])  # the wide window (2 blocks) misses tokens [20, 24)
    asked = [count_searches(g) for g in m.managers]
    hits, hit = m.get_computed_blocks(make_request(m, "B", [*range(24), 7]))
    assert hit == 20
    assert asked == [[24], [24, 20], [24]]  # the narrow window had kept 24: asked again
    assert [len(g) for g in hits.blocks] == [5, 5, 5]


def test_a_miss_returns_empty_blocks_for_every_group():
    m = make_manager(num_blocks=30, block_size=4, groups=[FULL, swa(8)], max_model_len=64)
    asked = [count_searches(g) for g in m.managers]
    hits, hit = m.get_computed_blocks(make_request(m, "B", range(20)))
    assert hit == 0 and hits.blocks == ([], [])
    assert asked == [[16], []]  # the hit is already 0: the window group is not asked
