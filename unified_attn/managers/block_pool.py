"""The block pool: KV-cache blocks, the free queue and the prefix-cache map.

Block 0 is the null block: it pads skipped positions in block tables and is never ref-counted,
touched, freed or cached. Freed blocks without a hash are prepended to the free queue (reused
first); hashed blocks are appended (least recently used evicted first). Eviction is lazy: a
hashed block keeps its hash in the free queue until `get_new_blocks` pops it.

With `enable_kv_cache_events` the pool also records what enters and leaves the prefix cache
(`managers/events.py`); `take_events()` drains them. Off by default: then the hot paths only
test one flag per call.

With `eviction="window_aware"` (`managers/eviction.py`) a block is taken from the free queue in
this order: a block without a hash at the head, else a cached block no prefix hit can use (dead),
else the head (LRU). The default `"lru"` is vLLM's order exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import repeat
from operator import add

import attrs

from unified_attn.managers.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from unified_attn.managers.eviction import (
    DeadBlockFinder,
    EvictionPolicy,
    GroupLayout,
    check_eviction,
)
from unified_attn.managers.free_queue import FreeKVCacheBlockQueue, KVCacheBlock
from unified_attn.managers.hashing import split_group_id, with_group_id
from unified_attn.managers.prefix_cache_map import BlockHashToBlockMap

__all__ = [
    "BlockHashToBlockMap",
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "PrefixCacheStats",
]


@attrs.define
class PrefixCacheStats:
    """Prefix-cache lookups: `queries` and `hits` count tokens."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def record(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hit_tokens


class BlockPool:
    """`num_blocks` blocks shared by every KV-cache group, with prefix caching.

    `eviction="window_aware"` evicts dead cached blocks first; `group_layouts` (one
    `GroupLayout` per group id) tell it which groups' hits need the whole prefix. Without
    layouts no block is ever dead and the order is LRU.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        *,
        eviction: EvictionPolicy = "lru",
        group_layouts: Sequence[GroupLayout] = (),
    ) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"BlockPool needs num_blocks >= 2 (block 0 is the null block), got {num_blocks}; "
                "give the KV cache more memory or use a smaller block size."
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_event_queue: list[KVCacheEvent] = []
        self.eviction = check_eviction(eviction)
        self.dead_blocks: DeadBlockFinder | None = None
        if eviction == "window_aware":
            cache = self.cached_block_hash_to_block
            self.dead_blocks = DeadBlockFinder(cache, group_layouts, num_blocks)

    # ---- lookup and caching ------------------------------------------------------------------

    def get_cached_block(
        self, block_hash: bytes, group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """One cached block per group for `block_hash`, or None if any group misses."""
        found = []
        for group_id in group_ids:
            block = self.cached_block_hash_to_block.get_one_block(
                with_group_id(block_hash, group_id)
            )
            if block is None:
                return None
            found.append(block)
        return found

    def get_cached_prefix(self, block_hashes: Iterable[bytes], group_id: int) -> list[KVCacheBlock]:
        """The group's cached block for each hash in order (the block `get_cached_block` would
        return), up to the first hash with none: the prefix-hit scan, one C loop."""
        keys = map(add, block_hashes, repeat(group_id.to_bytes(4, "big")))  # `with_group_id`
        return self.cached_block_hash_to_block.first_blocks(keys)

    def count_uncached_prefix(self, block_hashes: Iterable[bytes], group_id: int) -> int:
        """How many hashes, from the first, have no cached block of the group (one C loop)."""
        keys = map(add, block_hashes, repeat(group_id.to_bytes(4, "big")))
        return self.cached_block_hash_to_block.num_leading_misses(keys)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[bytes],
        num_cached_blocks: int,
        num_full_blocks: int,
        group_id: int,
        token_ids: Sequence[int] | None = None,
        block_size: int | None = None,
    ) -> None:
        """Cache `blocks[num_cached_blocks:num_full_blocks]` under `block_hashes` of the group.

        Null blocks (skipped positions) and blocks that already carry a hash are left alone.
        With events on, `token_ids` (the request's tokens) and `block_size` are required: one
        `BlockStored` per contiguous run of newly cached blocks (one per call unless the range
        has null or already cached blocks), so its tokens always match its hashes.
        """
        if not self.enable_caching:
            return
        stored: list[int] | None = None
        if self.enable_kv_cache_events:
            self._check_event_inputs(token_ids, block_size)
            stored = []
        finder = self.dead_blocks
        if finder is not None and not finder.is_chained(group_id):
            finder = None  # only whole-prefix groups keep their chains
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null or block.block_hash is not None:
                continue
            key = with_group_id(block_hashes[i], group_id)
            block.block_hash = key
            self.cached_block_hash_to_block.insert(key, block)
            if finder is not None and i:
                # The block before it holds the parent key (None when `evict_blocks` dropped
                # it: this block is then left out of the chains and evicted in LRU order).
                parent_key = blocks[i - 1].block_hash
                if parent_key is not None:
                    finder.key_cached(block, parent_key)
            if stored is not None:
                stored.append(i)
        if stored:
            assert token_ids is not None and block_size is not None
            for start, end in _contiguous_runs(stored):
                self._record_stored(block_hashes, start, end, group_id, token_ids, block_size)

    def adopt_external_block(
        self,
        block_hash: bytes,
        group_id: int,
        *,
        block_size: int,
        parent_block_hash: bytes | None = None,
        token_ids: Sequence[int] = (),
    ) -> KVCacheBlock:
        """Take a free block and cache it under `block_hash` of the group, for content filled
        from outside (another engine's exported block), so later lookups hit it.

        The block leaves like any new block, with `ref_cnt == 1`: write its content, then
        `free_blocks([block])`; it stays cached (at the free queue's tail) until evicted.
        `parent_block_hash` and `token_ids` (empty, or the block's `block_size` tokens) only
        describe it in the `BlockStored` event.
        """
        if not self.enable_caching:
            raise ValueError("adopt_external_block: prefix caching is off in this pool")
        if token_ids and len(token_ids) != block_size:
            raise ValueError(
                f"adopt_external_block: token_ids must be empty or one block of {block_size} "
                f"tokens, got {len(token_ids)}"
            )
        (block,) = self.get_new_blocks(1)
        key = with_group_id(block_hash, group_id)
        block.block_hash = key
        self.cached_block_hash_to_block.insert(key, block)
        finder = self.dead_blocks
        if finder is not None and finder.is_chained(group_id) and parent_block_hash is not None:
            finder.key_cached(block, with_group_id(parent_block_hash, group_id))
        if self.enable_kv_cache_events:
            tokens = list(token_ids)
            stored = BlockStored([block_hash], parent_block_hash, tokens, block_size, group_id)
            self.kv_event_queue.append(stored)
        return block

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        key = block.block_hash
        if key is None:
            return False
        block.block_hash = None
        self.cached_block_hash_to_block.pop(key, block.block_id)
        if self.dead_blocks is not None:
            if key not in self.cached_block_hash_to_block:
                self.dead_blocks.key_uncached(key, block.parent_block_hash)
            block.parent_block_hash = None
        if self.enable_kv_cache_events:
            block_hash, group_id = split_group_id(key)
            self.kv_event_queue.append(BlockRemoved([block_hash], group_id))
        return True

    # ---- events --------------------------------------------------------------------------------

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, in order (empty while events are off)."""
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    @staticmethod
    def _check_event_inputs(token_ids: Sequence[int] | None, block_size: int | None) -> None:
        if token_ids is None or block_size is None:
            missing = "token_ids" if token_ids is None else "block_size"
            raise ValueError(
                f"cache_full_blocks: KV-cache events are on, so the events need token_ids (the "
                f"request's tokens) and block_size, but {missing} is None; pass both"
            )

    def _record_stored(
        self,
        block_hashes: Sequence[bytes],
        start: int,
        end: int,
        group_id: int,
        token_ids: Sequence[int],
        block_size: int,
    ) -> None:
        """One `BlockStored` for the blocks at positions `[start, end)` of a request."""
        parent = block_hashes[start - 1] if start else None
        tokens = list(token_ids[start * block_size : end * block_size])
        hashes = list(block_hashes[start:end])
        self.kv_event_queue.append(BlockStored(hashes, parent, tokens, block_size, group_id))

    # ---- allocation ----------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` from the head of the free queue, evicting their cached hashes."""
        if num_blocks < 0:
            raise ValueError(f"get_new_blocks: num_blocks must be >= 0, got {num_blocks}")
        num_free = self.free_block_queue.num_free_blocks
        if num_blocks > num_free:
            raise ValueError(
                f"Cannot get {num_blocks} free blocks from the pool: only {num_free} are free; "
                "check with get_num_free_blocks() before allocating."
            )
        if self.dead_blocks is not None:
            return self._get_new_blocks_window_aware(num_blocks)
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            if block.block_hash is not None:
                self._maybe_evict_cached_block(block)
            block.ref_cnt = 1
        return blocks

    def _get_new_blocks_window_aware(self, num_blocks: int) -> list[KVCacheBlock]:
        """Each block: the head if it carries no hash, else a dead block, else the head (LRU).

        Blocks without a hash at the head go in one batch; a hashed one goes alone, since its
        eviction may kill blocks that must come before the next one."""
        finder, queue = self.dead_blocks, self.free_block_queue
        assert finder is not None
        blocks: list[KVCacheBlock] = []
        while len(blocks) < num_blocks:
            head = queue.head.next_free_block
            assert head is not None
            if head.block_hash is None:
                run = queue.popleft_n(self._leading_unhashed(num_blocks - len(blocks)))
                for block in run:
                    block.ref_cnt = 1
                blocks += run
                continue
            dead = finder.pop_dead(queue) if finder.suspects else None
            victim = dead if dead is not None else queue.popleft()
            self._maybe_evict_cached_block(victim)
            victim.ref_cnt = 1
            blocks.append(victim)
        return blocks

    def _leading_unhashed(self, limit: int) -> int:
        """How many of the first `limit` free blocks (there are that many) carry no hash."""
        count, block = 0, self.free_block_queue.head.next_free_block
        while count < limit and block is not None and block.block_hash is None:
            count += 1
            block = block.next_free_block
        return count

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, reviving free ones (they keep their hash)."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block; pass blocks in eviction order (a request's tail first)."""
        blocks = [b for b in ordered_blocks if not b.is_null]
        for block in blocks:  # check all first: a failed call changes nothing
            if block.ref_cnt <= 0:
                raise RuntimeError(f"free_blocks: block {block.block_id} is already free")
        unhashed: list[KVCacheBlock] = []
        hashed: list[KVCacheBlock] = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (hashed if block.block_hash is not None else unhashed).append(block)
        if unhashed:
            self.free_block_queue.prepend_n(unhashed)
        if hashed:
            self.free_block_queue.append_n(hashed)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the given blocks from the prefix cache; blocks in use stay allocated."""
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(
                    f"evict_blocks: block id {block_id} is outside [0, {self.num_blocks})"
                )
            self._maybe_evict_cached_block(self.blocks[block_id])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed while no block is in use; returns success."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block.clear()
        if self.dead_blocks is not None:
            self.dead_blocks.clear()
        for block in self.blocks:
            block.block_hash = block.parent_block_hash = None
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def get_usage(self) -> float:
        """Fraction of usable blocks (all but the null block) that are in use."""
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    def num_cached_blocks(self) -> int:
        return len(self.cached_block_hash_to_block)


def _contiguous_runs(positions: list[int]) -> list[tuple[int, int]]:
    """`[3, 4, 5, 7]` -> `[(3, 6), (7, 8)]`: half-open runs of consecutive positions."""
    runs: list[tuple[int, int]] = []
    start = prev = positions[0]
    for pos in positions[1:]:
        if pos != prev + 1:
            runs.append((start, prev + 1))
            start = pos
        prev = pos
    runs.append((start, prev + 1))
    return runs
