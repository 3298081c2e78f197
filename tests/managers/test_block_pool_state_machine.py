"""Hypothesis state machine over `BlockPool` against a plain-Python model of it.

The model keeps what KV_CACHE_RULES.md (rules 1-5) promises: the exact free-queue order (unhashed
blocks prepended, hashed appended, allocation from the head), one ref per owner, lazy eviction of
hashes at allocation, and the prefix-cache map. After every step the invariants compare the pool
with the model and walk the intrusive free list in both directions.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tests.managers.helpers import walk_free_queue
from unified_attn.managers.block_pool import BlockPool, KVCacheBlock
from unified_attn.managers.hashing import with_group_id

# A few fake block hashes, so that duplicate keys (two blocks with the same content) happen.
FAKE_HASHES = [bytes([i]) * 32 for i in range(6)]
GROUP_IDS = st.lists(st.integers(0, 2), min_size=1, max_size=3)


class BlockPoolMachine(RuleBasedStateMachine):
    """Owners are lists of block ids (like a request's block table); freeing is tail first."""

    def __init__(self) -> None:
        super().__init__()
        self.pool: BlockPool | None = None
        self.owners: list[list[int]] = []
        self.queue: list[int] = []  # model of the free queue, head first
        self.hashes: dict[int, bytes] = {}  # block id -> cache key (hash + group id)

    @initialize(num_blocks=st.integers(2, 14))
    def make_pool(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks, enable_caching=True)
        self.queue = list(range(1, num_blocks))

    # ---- helpers -------------------------------------------------------------------------------

    @property
    def blocks(self) -> list[KVCacheBlock]:
        assert self.pool is not None
        return self.pool.blocks

    def model_ref_counts(self) -> Counter[int]:
        return Counter(bid for owner in self.owners for bid in owner if bid != 0)

    def snapshot(self) -> tuple:
        assert self.pool is not None
        return (
            self.pool.get_num_free_blocks(),
            tuple((b.ref_cnt, b.block_hash) for b in self.blocks),
            tuple(walk_free_queue(self.pool)),
            self.pool.num_cached_blocks(),
        )

    def owned_ids(self) -> list[int]:
        return sorted({bid for owner in self.owners for bid in owner if bid != 0})

    # ---- rules ---------------------------------------------------------------------------------

    @rule(data=st.data())
    def get_new_blocks(self, data: st.DataObject) -> None:
        assert self.pool is not None
        num_free = self.pool.get_num_free_blocks()
        n = data.draw(st.integers(0, num_free + 2), label="n")
        if n > num_free:
            before = self.snapshot()
            try:
                self.pool.get_new_blocks(n)
            except ValueError:
                pass
            else:
                raise AssertionError(f"get_new_blocks({n}) with {num_free} free did not raise")
            assert self.snapshot() == before, "a refused get_new_blocks changed the pool"
            return
        got = self.pool.get_new_blocks(n)
        expected, self.queue = self.queue[:n], self.queue[n:]
        assert [b.block_id for b in got] == expected, "blocks must be popped from the queue head"
        for block in got:
            assert block.ref_cnt == 1
            assert block.block_hash is None, "lazy eviction must clear the hash on allocation"
            self.hashes.pop(block.block_id, None)
        self.owners.append(expected)

    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        # Prefix hits touch cached blocks (free or in use); the null block is skipped.
        candidates = sorted({0, *self.hashes, *self.owned_ids()})
        ids = data.draw(st.lists(st.sampled_from(candidates), max_size=4), label="touch")
        assert self.pool is not None
        self.pool.touch([self.blocks[i] for i in ids])
        for bid in ids:
            if bid != 0 and bid in self.queue:
                self.queue.remove(bid)
        if data.draw(st.booleans(), label="join existing owner") and self.owners:
            owner = data.draw(st.sampled_from(range(len(self.owners))), label="owner")
            self.owners[owner].extend(ids)
        else:
            self.owners.append(list(ids))

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def free_blocks(self, data: st.DataObject) -> None:
        index = data.draw(st.sampled_from(range(len(self.owners))), label="owner")
        counts = self.model_ref_counts()
        owner = self.owners.pop(index)
        assert self.pool is not None
        self.pool.free_blocks(reversed([self.blocks[i] for i in owner]))
        released = []  # in the order the blocks reach ref_cnt 0
        for bid in reversed(owner):
            if bid != 0:
                counts[bid] -= 1
                if counts[bid] == 0:
                    released.append(bid)
        unhashed = [bid for bid in released if bid not in self.hashes]
        hashed = [bid for bid in released if bid in self.hashes]
        self.queue = unhashed + self.queue + hashed

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def cache_full_blocks(self, data: st.DataObject) -> None:
        owner = self.owners[data.draw(st.sampled_from(range(len(self.owners))), label="owner")]
        start = data.draw(st.integers(0, len(owner)), label="num_cached")
        end = data.draw(st.integers(start, len(owner)), label="num_full")
        hashes = data.draw(
            st.lists(st.sampled_from(FAKE_HASHES), min_size=len(owner), max_size=len(owner)),
            label="hashes",
        )
        group_id = data.draw(st.integers(0, 2), label="group_id")
        assert self.pool is not None
        self.pool.cache_full_blocks([self.blocks[i] for i in owner], hashes, start, end, group_id)
        for i in range(start, end):
            bid = owner[i]
            if bid != 0 and bid not in self.hashes:
                self.hashes[bid] = with_group_id(hashes[i], group_id)

    @rule(block_hash=st.sampled_from(FAKE_HASHES), group_ids=GROUP_IDS)
    def get_cached_block(self, block_hash: bytes, group_ids: list[int]) -> None:
        assert self.pool is not None
        found = self.pool.get_cached_block(block_hash, group_ids)
        holders = [
            {bid for bid, key in self.hashes.items() if key == with_group_id(block_hash, g)}
            for g in group_ids
        ]
        if not all(holders):
            assert found is None, f"expected a miss for groups {group_ids}, got {found}"
            return
        assert found is not None and len(found) == len(group_ids)
        for block, group_holders, g in zip(found, holders, group_ids, strict=True):
            assert block.block_id in group_holders
            assert block.block_hash == with_group_id(block_hash, g)

    @rule(data=st.data())
    def evict_blocks(self, data: st.DataObject) -> None:
        assert self.pool is not None
        ids = data.draw(st.lists(st.integers(0, self.pool.num_blocks - 1), max_size=4))
        self.pool.evict_blocks(ids)
        for bid in ids:
            self.hashes.pop(bid, None)  # the block keeps its place in the free queue

    @rule(offset=st.integers(0, 3))
    def evict_out_of_range(self, offset: int) -> None:
        assert self.pool is not None
        before = self.snapshot()
        try:
            self.pool.evict_blocks([self.pool.num_blocks + offset])
        except ValueError:
            pass
        else:
            raise AssertionError("evict_blocks accepted a block id outside the pool")
        assert self.snapshot() == before

    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.pool is not None
        in_use = bool(self.model_ref_counts())
        assert self.pool.reset_prefix_cache() is not in_use
        if not in_use:
            self.hashes.clear()

    # ---- invariants ----------------------------------------------------------------------------

    @invariant()
    def ref_counts_match_owners(self) -> None:
        if self.pool is None:
            return
        expected = self.model_ref_counts()
        for block in self.blocks[1:]:
            assert block.ref_cnt >= 0, f"{block} has a negative ref count"
            assert block.ref_cnt == expected[block.block_id], (
                f"{block}: ref_cnt {block.ref_cnt}, owners {expected[block.block_id]}"
            )

    @invariant()
    def free_queue_is_consistent(self) -> None:
        if self.pool is None:
            return
        forward = walk_free_queue(self.pool)
        free_ids = {b.block_id for b in self.blocks[1:] if b.ref_cnt == 0}
        assert set(forward) == free_ids, "free queue != blocks with ref_cnt 0"
        assert forward == self.queue, f"free queue order {forward}, expected {self.queue}"
        for block in self.blocks:
            if block.block_id not in free_ids:
                assert block.prev_free_block is None and block.next_free_block is None

    @invariant()
    def null_block_untouched(self) -> None:
        if self.pool is None:
            return
        null = self.pool.null_block
        assert null is self.blocks[0] and null.is_null
        assert null.ref_cnt == 0 and null.block_hash is None
        assert null.prev_free_block is None and null.next_free_block is None
        assert not any(b.is_null for b in self.blocks[1:])

    @invariant()
    def cache_map_is_consistent(self) -> None:
        if self.pool is None:
            return
        actual = {b.block_id: b.block_hash for b in self.blocks if b.block_hash is not None}
        assert actual == self.hashes
        entries = self.pool.cached_block_hash_to_block._cache
        in_map = {}
        for key, entry in entries.items():
            group = entry if isinstance(entry, dict) else {entry.block_id: entry}
            assert group, f"empty cache entry for {key!r}"
            for bid, block in group.items():
                assert block.block_id == bid and block.block_hash == key
                assert bid not in in_map, f"block {bid} is in the cache map twice"
                in_map[bid] = key
        assert in_map == actual, "every hashed block (and only those) is in the cache map"
        assert self.pool.num_cached_blocks() == len({*actual.values()})
        for key in actual.values():
            assert self.pool.cached_block_hash_to_block.get_one_block(key) is not None
        assert 0.0 <= self.pool.get_usage() <= 1.0


TestBlockPoolStateMachine = BlockPoolMachine.TestCase
TestBlockPoolStateMachine.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
