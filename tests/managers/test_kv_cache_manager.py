"""The scheduler-facing API: admission without mutation, errors, stats, preemption."""

import pytest

from tests.managers.helpers import FULL, admit, free_ids, make_manager, make_request, step
from unified_attn.managers import KVCacheBlocks, SchedulerKVCacheConfig


def snapshot(m, request):
    pool = m.block_pool
    return (
        free_ids(m),
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        m.get_block_ids(request),
        pool.num_cached_blocks(),
    )


def test_failed_allocation_changes_nothing_and_counts_revived_hits():
    m = make_manager(num_blocks=6, block_size=4)
    a = make_request(m, "A", range(16))
    admit(m, a)
    m.free(a)  # four cached, free blocks
    b = make_request(m, "B", [*range(16), *range(100, 108)])
    hits, hit = m.get_computed_blocks(b)
    assert hit == 16
    before = snapshot(m, b)
    # 2 new blocks + 4 hit blocks that must leave the free queue > 5 free blocks
    assert m.allocate_slots(b, 8, hit, hits) is None
    assert snapshot(m, b) == before
    c = make_request(m, "C", [*range(16), 100, 101])
    hits, hit, new = admit(m, c)
    assert new is not None and m.block_pool.get_num_free_blocks() == 0


def test_nothing_to_schedule_is_an_error():
    m = make_manager()
    r = make_request(m, "R", range(4))
    with pytest.raises(ValueError, match="nothing to schedule"):
        m.allocate_slots(r, 0)
    with pytest.raises(ValueError, match="num_new_tokens=-1"):
        m.allocate_slots(r, -1)


def test_more_than_max_model_len_is_an_error():
    m = make_manager(max_model_len=32)
    r = make_request(m, "R", range(40))
    with pytest.raises(ValueError, match="max_model_len=32"):
        m.allocate_slots(r, 40)
    assert m.get_block_ids(r) == ([],)


def test_group_count_mismatch_is_an_error():
    m = make_manager()
    r = make_request(m, "R", range(4))
    with pytest.raises(ValueError, match="expected 1"):
        m.allocate_slots(r, 4, new_computed_blocks=KVCacheBlocks(([], [])))


def test_freeing_an_unknown_request_is_a_no_op():
    m = make_manager()
    m.free("nobody")
    assert m.block_pool.get_num_free_blocks() == 10


def test_preempted_request_resumes_from_its_own_cached_prefix():
    m = make_manager(num_blocks=20, block_size=4)
    r = make_request(m, "R", range(10))
    admit(m, r)
    for tok in range(6):
        r.append_output_token_ids(tok)
        step(m, r)
    table = m.get_block_ids(r)[0]
    m.free(r)  # preemption by recompute
    r.num_computed_tokens = 0
    hits, hit, _new = admit(m, r)
    assert hit == 12 and hits.get_block_ids()[0] == table[:3]
    assert m.get_block_ids(r)[0][:3] == table[:3]


def test_prefix_cache_stats_and_reset():
    m = make_manager(num_blocks=20, block_size=4)
    a = make_request(m, "A", range(12))
    admit(m, a)
    b = make_request(m, "B", range(13))
    admit(m, b)
    stats = m.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 25, 12)
    assert stats.hit_rate == pytest.approx(12 / 25)
    assert m.reset_prefix_cache() is False  # blocks in use
    m.free(a)
    m.free(b)
    assert m.usage == 0.0
    assert m.reset_prefix_cache() is True
    assert m.prefix_cache_stats.queries == 0
    assert m.get_computed_blocks(make_request(m, "C", range(13)))[1] == 0


def test_lookahead_slots_are_allocated_but_never_cached():
    m = make_manager(num_blocks=20, block_size=4)
    r = make_request(m, "R", range(8))
    new = m.allocate_slots(r, 8, num_lookahead_tokens=4)
    assert new.get_block_ids() == ([1, 2, 3],)
    assert m.block_pool.num_cached_blocks() == 2


def test_groups_accept_plain_tuples():
    config = SchedulerKVCacheConfig(8, 16, [FULL])
    assert config.groups[0].manager_cls is FULL[0]
    with pytest.raises(TypeError, match=r"needs a FullAttentionManager\.Config"):
        SchedulerKVCacheConfig(8, 16, [(FULL[0], object())])
