"""Window-aware eviction (`managers/eviction.py`): the switch, the chain and twin rules, lazy
verdicts (a revived suspect is not taken), and LRU order whenever no block is dead."""

from __future__ import annotations

import pytest

from tests.managers.helpers import FULL, admit, free_ids, ids, make_manager, make_request
from unified_attn.managers import SlidingWindowManager
from unified_attn.managers.block_pool import BlockPool
from unified_attn.managers.events import BlockRemoved
from unified_attn.managers.eviction import DeadBlockFinder, GroupLayout

SLIDING = (SlidingWindowManager, SlidingWindowManager.Config(sliding_window=8))
H = [bytes([i]) * 32 for i in range(8)]  # fake chained hashes: H[i] follows H[i - 1]


def chain_pool(num_blocks: int = 9) -> BlockPool:
    return BlockPool(num_blocks, eviction="window_aware", group_layouts=[GroupLayout(16, True)])


def cache_chain(pool: BlockPool, hashes: list[bytes]) -> list[int]:
    """Allocate, cache (one full-attention chain) and free blocks for `hashes`; their ids."""
    blocks = pool.get_new_blocks(len(hashes))
    pool.cache_full_blocks(blocks, hashes, 0, len(hashes), group_id=0)
    pool.free_blocks(reversed(blocks))
    return ids(blocks)


def free_ids_of(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue]


# ---- the switch --------------------------------------------------------------------------------


def test_lru_is_the_default_and_unknown_policies_are_refused():
    assert make_manager().block_pool.eviction == "lru"
    assert make_manager().block_pool.dead_blocks is None
    with pytest.raises(ValueError, match="eviction must be one of"):
        make_manager(eviction="fifo")
    with pytest.raises(ValueError, match="'window_aware'"):
        BlockPool(4, eviction="mru")  # type: ignore[arg-type]


def test_rule_4_example_keeps_its_exact_order_with_the_switch_on():
    # KV_CACHE_RULES.md rule 4: nothing is dead, so the order is LRU exactly.
    for eviction in ("lru", "window_aware"):
        m = make_manager(num_blocks=11, block_size=16, eviction=eviction)
        a = make_request(m, "A", range(55))
        b = make_request(m, "B", [*range(48), *range(100, 105)])
        admit(m, a)
        admit(m, b)
        m.free(a)
        m.free(b)
        assert free_ids(m) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]


# ---- the rules ---------------------------------------------------------------------------------


def test_twin_rule_a_sliding_block_goes_right_after_its_full_attention_twin():
    results = {}
    for eviction in ("lru", "window_aware"):
        m = make_manager(num_blocks=13, block_size=4, groups=(FULL, SLIDING), eviction=eviction)
        a = make_request(m, "A", range(16))
        admit(m, a)
        assert m.get_block_ids(a) == ([1, 2, 3, 4], [5, 6, 7, 8])
        m.free(a)  # free queue: [9, 10, 11, 12, 4, 3, 2, 1, 8, 7, 6, 5]
        b = make_request(m, "B", range(100, 112))
        admit(m, b)
        c = make_request(m, "C", [*range(16), 99])
        results[eviction] = (m.get_block_ids(b), m.get_computed_blocks(c)[1])
    # LRU takes full blocks 4 and 3; window-aware takes 4, then its dead twin 8 (position 3
    # of the sliding group), so C still hits 12 tokens instead of 8.
    assert results["lru"] == (([9, 10, 11], [12, 4, 3]), 8)
    assert results["window_aware"] == (([9, 10, 11], [12, 4, 8]), 12)


def test_chain_rule_children_of_an_evicted_block_go_before_older_live_blocks():
    pool = chain_pool()
    older = cache_chain(pool, [H[5], H[6]])  # another chain, less recently used
    chain = cache_chain(pool, H[:3])
    assert (older, chain) == ([1, 2], [3, 4, 5])
    assert free_ids_of(pool) == [6, 7, 8, 2, 1, 5, 4, 3]
    pool.evict_blocks([3])  # the chain's first block: blocks 4 and 5 can never be hit
    taken = ids(pool.get_new_blocks(4))
    assert taken == [6, 7, 8, 4]  # blocks without a hash first, then the dead child
    assert ids(pool.get_new_blocks(1)) == [5]  # the cascade: 5's parent 4 is gone now
    assert pool.get_cached_block(H[6], [0]) is not None  # the older live chain survives
    assert pool.dead_blocks is not None and pool.dead_blocks.num_dead_evicted == 2


def test_a_suspect_whose_parent_is_cached_again_is_not_taken():
    pool = chain_pool(7)
    chain = cache_chain(pool, H[:2])  # blocks 1, 2 (queue: 3, 4, 5, 6, 2, 1)
    pool.evict_blocks([chain[0]])  # block 2 becomes a suspect
    (again,) = pool.get_new_blocks(1)  # block 3: no hash, taken first
    pool.cache_full_blocks([again], [H[0]], 0, 1, group_id=0)  # the parent is cached again
    pool.free_blocks([again])
    assert ids(pool.get_new_blocks(4)) == [4, 5, 6, 2]  # LRU order: 2 is not dead any more


def test_adopted_blocks_chain_on_their_parent_hash():
    pool = chain_pool(5)
    first = pool.adopt_external_block(H[0], 0, block_size=16)
    second = pool.adopt_external_block(H[1], 0, block_size=16, parent_block_hash=H[0])
    pool.free_blocks([second, first])  # queue: 3, 4, 2, 1
    pool.evict_blocks([first.block_id])
    assert ids(pool.get_new_blocks(3)) == [3, 4, second.block_id]


def test_dead_evictions_emit_block_removed():
    pool = chain_pool()
    cache_chain(pool, H[:2])
    pool.enable_kv_cache_events = True
    pool.evict_blocks([1])
    pool.get_new_blocks(7)
    # evict_blocks removes block 1's hash; the dead child 2 is evicted when first reused.
    assert pool.take_events() == [BlockRemoved([H[0]], 0), BlockRemoved([H[1]], 0)]


def test_twins_need_a_block_size_that_is_a_multiple_of_the_full_groups():
    layouts = [GroupLayout(16, True), GroupLayout(32), GroupLayout(8), GroupLayout(16, True)]
    finder = DeadBlockFinder(BlockPool(2).cached_block_hash_to_block, layouts, num_blocks=8)
    tail = [g.to_bytes(4, "big") for g in range(4)]
    assert finder.backers == {tail[0]: (tail[3],), tail[1]: (tail[0], tail[3]), tail[3]: (tail[0],)}
    assert finder.backed == {tail[0]: [tail[1], tail[3]], tail[3]: [tail[0], tail[1]]}


def test_reset_prefix_cache_forgets_chains_and_suspects():
    pool = chain_pool()
    cache_chain(pool, H[:3])
    pool.evict_blocks([1])
    finder = pool.dead_blocks
    assert finder is not None and finder.suspects and finder.children
    assert pool.reset_prefix_cache()
    assert not finder.suspects and not finder.children
    assert all(b.block_hash is None and b.parent_block_hash is None for b in pool.blocks)


def test_without_layouts_nothing_is_dead():
    pool = BlockPool(6, eviction="window_aware")
    cache_chain(pool, H[:3])
    pool.evict_blocks([1])
    assert ids(pool.get_new_blocks(5)) == [4, 5, 3, 2, 1]
