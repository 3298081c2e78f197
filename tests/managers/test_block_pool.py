import pytest

from unified_attn.managers.block_pool import BlockPool
from unified_attn.managers.free_queue import FreeKVCacheBlockQueue, KVCacheBlock
from unified_attn.managers.hashing import with_group_id


def queue_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue]


def test_null_block_is_block_zero_and_out_of_the_queue():
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert queue_ids(pool) == [1, 2, 3, 4]
    assert pool.get_num_free_blocks() == 4


def test_needs_two_blocks():
    with pytest.raises(ValueError, match="num_blocks >= 2"):
        BlockPool(1)


def test_get_new_blocks_pops_head_with_ref_one():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(2)
    assert [b.block_id for b in blocks] == [1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert queue_ids(pool) == [3, 4, 5]


def test_asking_for_too_many_blocks_raises_and_changes_nothing():
    pool = BlockPool(4)
    with pytest.raises(ValueError, match="Cannot get 4 free blocks"):
        pool.get_new_blocks(4)
    assert queue_ids(pool) == [1, 2, 3]
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_free_prepends_unhashed_and_appends_hashed():
    pool = BlockPool(6)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_blocks([a], [b"h" * 32], 0, 1, group_id=0)
    pool.free_blocks([c, b, a])  # reverse order, like a request
    assert queue_ids(pool) == [3, 2, 4, 5, 1]


def test_lazy_eviction_on_reuse():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [b"x" * 32, b"y" * 32], 0, 2, group_id=0)
    pool.free_blocks([b, a])
    assert pool.get_cached_block(b"x" * 32, [0]) == [a]  # still cached while free
    (first,) = pool.get_new_blocks(1)
    assert first is b and b.block_hash is None
    assert pool.get_cached_block(b"y" * 32, [0]) is None
    assert pool.get_cached_block(b"x" * 32, [0]) == [a]


def test_touch_revives_a_free_cached_block_keeping_its_hash():
    pool = BlockPool(4)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], [b"k" * 32], 0, 1, group_id=0)
    pool.free_blocks([a])
    pool.touch([a])
    assert a.ref_cnt == 1 and a.block_hash is not None
    assert queue_ids(pool) == [2, 3]
    pool.touch([a, pool.null_block])
    assert a.ref_cnt == 2 and pool.null_block.ref_cnt == 0


def test_null_block_is_skipped_everywhere():
    pool = BlockPool(4)
    null = pool.null_block
    pool.free_blocks([null])
    pool.cache_full_blocks([null], [b"z" * 32], 0, 1, group_id=0)
    assert null.ref_cnt == 0 and null.block_hash is None
    assert 0 not in queue_ids(pool)


def test_cache_key_includes_group_id():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"s" * 32], 0, 1, group_id=0)
    assert pool.get_cached_block(b"s" * 32, [0]) == [a]
    assert pool.get_cached_block(b"s" * 32, [1]) is None
    pool.cache_full_blocks([b], [b"s" * 32], 0, 1, group_id=1)
    assert pool.get_cached_block(b"s" * 32, [0, 1]) == [a, b]
    assert a.block_hash == with_group_id(b"s" * 32, 0)


def test_duplicate_keys_are_allowed_and_popped_individually():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"d" * 32], 0, 1, group_id=0)
    pool.cache_full_blocks([b], [b"d" * 32], 0, 1, group_id=0)
    assert pool.get_cached_block(b"d" * 32, [0]) == [a]
    pool.evict_blocks([a.block_id])
    assert pool.get_cached_block(b"d" * 32, [0]) == [b]
    assert a.ref_cnt == 1  # eviction from the cache does not free a block in use


def test_evict_blocks_rejects_unknown_ids():
    pool = BlockPool(4)
    with pytest.raises(ValueError, match="outside"):
        pool.evict_blocks([7])


def test_reset_prefix_cache_only_when_nothing_is_in_use():
    pool = BlockPool(4)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], [b"r" * 32], 0, 1, group_id=0)
    assert pool.reset_prefix_cache() is False
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is True
    assert a.block_hash is None and pool.num_cached_blocks() == 0


def test_usage_excludes_the_null_block():
    pool = BlockPool(5)
    assert pool.get_usage() == 0.0
    pool.get_new_blocks(2)
    assert pool.get_usage() == 0.5
    pool.get_new_blocks(2)
    assert pool.get_usage() == 1.0


def test_double_free_is_an_error():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(RuntimeError, match="already free"):
        pool.free_blocks([a])


class TestFreeQueue:
    def make(self, n=5):
        blocks = [KVCacheBlock(i) for i in range(n)]
        return blocks, FreeKVCacheBlockQueue(blocks)

    def ids(self, queue):
        return [b.block_id for b in queue]

    def test_popleft_n_remove_append_prepend(self):
        blocks, queue = self.make()
        assert [b.block_id for b in queue.popleft_n(2)] == [0, 1]
        queue.remove(blocks[3])
        assert self.ids(queue) == [2, 4]
        queue.append(blocks[0])
        queue.prepend_n([blocks[3], blocks[1]])
        assert self.ids(queue) == [3, 1, 2, 4, 0]
        assert queue.num_free_blocks == 5

    def test_links_are_consistent_backwards(self):
        blocks, queue = self.make()
        queue.remove(blocks[2])
        back = []
        node = queue.tail.prev_free_block
        while node is not queue.head:
            back.append(node.block_id)
            node = node.prev_free_block
        assert back == [4, 3, 1, 0]

    def test_empty_queue_errors(self):
        _, queue = self.make(1)
        queue.popleft()
        with pytest.raises(ValueError, match="No free blocks"):
            queue.popleft()
        with pytest.raises(ValueError):
            queue.popleft_n(1)

    def test_remove_of_unlinked_block_errors(self):
        blocks, queue = self.make(2)
        queue.popleft()
        with pytest.raises(RuntimeError, match="not in the free queue"):
            queue.remove(blocks[0])


def test_a_failed_free_changes_nothing():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.free_blocks([b])
    with pytest.raises(RuntimeError, match="already free"):
        pool.free_blocks([a, b])
    assert a.ref_cnt == 1 and queue_ids(pool) == [2, 3]
