"""Sliding window: skipped tokens, in-place recycling, right-aligned hits, admission cap."""

import pytest

from tests.managers.helpers import admit, ids, make_manager, make_request, step
from unified_attn.managers import SlidingWindowManager
from unified_attn.managers.block_pool import BlockPool


def swa(window):
    return (SlidingWindowManager, SlidingWindowManager.Config(sliding_window=window))


def make_swa_manager(window, block_size, num_blocks=20, max_model_len=100, **kwargs):
    pool = BlockPool(num_blocks)
    manager = SlidingWindowManager(
        SlidingWindowManager.Config(sliding_window=window),
        block_size=block_size,
        block_pool=pool,
        group_id=0,
        enable_caching=True,
        max_model_len=max_model_len,
        **kwargs,
    )
    return pool, manager


def cache_pattern(pool, pattern):
    """Cache one block per position and evict those marked False; returns hashes, blocks."""
    hashes = [bytes([i + 1]) * 32 for i in range(len(pattern))]
    blocks = pool.get_new_blocks(len(pattern))
    pool.cache_full_blocks(blocks, hashes, 0, len(pattern), group_id=0)
    pool.free_blocks(list(reversed(blocks)))
    pool.evict_blocks([b.block_id for b, keep in zip(blocks, pattern, strict=False) if not keep])
    return hashes, blocks


def test_skipped_tokens():
    _, m = make_swa_manager(window=4, block_size=2)
    assert [m.get_num_skipped_tokens(n) for n in (0, 3, 4, 5, 7)] == [0, 0, 1, 2, 4]


def test_block_is_freed_only_when_all_its_tokens_are_out_of_the_window():
    m = make_manager(num_blocks=10, block_size=2, groups=[swa(4)])
    a = make_request(m, "A", range(4))
    admit(m, a)
    assert m.get_block_ids(a) == ([1, 2],)
    a.append_output_token_ids(4)
    step(m, a)  # 4 computed: token 1 is still in the window of token 4
    assert m.get_block_ids(a) == ([1, 2, 3],)
    a.append_output_token_ids(5)
    step(m, a)  # 5 computed: tokens 0 and 1 are out, block 0 recycled in place
    assert m.get_block_ids(a) == ([0, 2, 3],)
    assert m.block_pool.blocks[1].ref_cnt == 0


def test_right_to_left_hit_finds_the_run_ending_at_the_boundary():
    pool, m = make_swa_manager(window=4, block_size=2)
    pattern = [True, True, False, True, False, False, True, True, False, False, False]
    hashes, blocks = cache_pattern(pool, pattern)
    hit_blocks, hit = m.find_longest_cache_hit(hashes, 22, alignment=2)
    assert hit == 16
    assert ids(hit_blocks) == [0] * 6 + [blocks[6].block_id, blocks[7].block_id]


def test_short_prefix_run_from_block_zero_still_counts():
    pool, m = make_swa_manager(window=8, block_size=2)  # needs 4 contiguous blocks
    hashes, blocks = cache_pattern(pool, [True, True, False, False])
    hit_blocks, hit = m.find_longest_cache_hit(hashes, 8, alignment=2)
    assert hit == 4 and ids(hit_blocks) == ids(blocks[:2])


def test_run_must_end_on_an_aligned_boundary():
    pool, m = make_swa_manager(window=3, block_size=2)  # needs 1 block
    hashes, _blocks = cache_pattern(pool, [False, False, True, False])
    assert m.find_longest_cache_hit(hashes, 8, alignment=2)[1] == 6
    assert m.find_longest_cache_hit(hashes, 8, alignment=4)[1] == 0


def test_hit_adopts_only_the_window_blocks():
    m = make_manager(num_blocks=30, block_size=2, groups=[swa(4)])
    a = make_request(m, "A", range(12))
    admit(m, a)  # computed at once: all six blocks cached
    m.free(a)
    b = make_request(m, "B", [*range(12), 50])
    hits, hit, _ = admit(m, b)
    assert hit == 12
    table = m.get_block_ids(b)[0]
    assert table[:4] == [0, 0, 0, 0] and table[4:6] == ids(hits.blocks[0])[4:6]


def test_admission_cap_lets_a_long_prompt_in():
    m = make_manager(
        num_blocks=8, block_size=2, groups=[swa(4)], max_model_len=100, max_in_flight_tokens=4
    )
    assert m.max_blocks_per_request() == [5]  # cdiv(min(3 + 4, 100), 2) + 1
    long = make_request(m, "L", range(50))
    assert m.allocate_slots(long, 4, full_sequence_must_fit=True) is not None
    long.num_computed_tokens = 4
    while long.num_computed_tokens < 50:
        assert step(m, long, 4 if long.num_computed_tokens + 4 <= 50 else 2) is not None
        live = [b for b in m.get_blocks(long).blocks[0] if not b.is_null]
        assert len(live) <= 5


def test_full_sequence_must_fit_refuses_without_changes_when_the_cap_exceeds_the_pool():
    m = make_manager(num_blocks=4, block_size=2, groups=[swa(8)], max_model_len=100)
    r = make_request(m, "R", range(40))
    assert m.allocate_slots(r, 4, full_sequence_must_fit=True) is None
    assert m.get_block_ids(r) == ([],) and m.block_pool.get_num_free_blocks() == 3


@pytest.mark.parametrize("window", [0, -3])
def test_window_must_be_positive(window):
    with pytest.raises(ValueError, match="sliding_window"):
        SlidingWindowManager.Config(sliding_window=window)


def test_group_stats_count_recycled_and_hit_blocks():
    m = make_manager(num_blocks=30, block_size=2, groups=[swa(4)])
    a = make_request(m, "A", range(12))
    admit(m, a)
    a.append_output_token_ids(12)
    step(m, a)  # 12 settled: blocks 0..3 out of the window
    assert m.group_stats()[0]["blocks_freed_early"] == 4
    b = make_request(m, "B", [*range(12), 12, 40])
    admit(m, b)
    assert m.group_stats()[0]["hit_blocks"] == 2  # only the window run is adopted
