"""The block pool: KV-cache blocks, the free queue and the prefix-cache map.

Block 0 is the null block: it pads skipped positions in block tables and is never ref-counted,
touched, freed or cached. Freed blocks without a hash are prepended to the free queue (reused
first); hashed blocks are appended (least recently used evicted first). Eviction is lazy: a
hashed block keeps its hash in the free queue until `get_new_blocks` pops it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from unified_attn.managers.free_queue import FreeKVCacheBlockQueue, KVCacheBlock
from unified_attn.managers.hashing import with_group_id

__all__ = ["BlockPool", "FreeKVCacheBlockQueue", "KVCacheBlock", "PrefixCacheStats"]


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


class BlockHashToBlockMap:
    """`hash+group -> block`, allowing duplicates (two blocks may hold the same content).

    A single block is stored bare and becomes a `{block_id: block}` dict on the second insert.
    """

    def __init__(self) -> None:
        self._cache: dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def __len__(self) -> int:
        return len(self._cache)

    def get_one_block(self, key: bytes) -> KVCacheBlock | None:
        entry = self._cache.get(key)
        if entry is None or isinstance(entry, KVCacheBlock):
            return entry
        return next(iter(entry.values()))

    def insert(self, key: bytes, block: KVCacheBlock) -> None:
        entry = self._cache.get(key)
        if entry is None:
            self._cache[key] = block
        elif isinstance(entry, KVCacheBlock):
            self._cache[key] = {entry.block_id: entry, block.block_id: block}
        else:
            entry[block.block_id] = block

    def pop(self, key: bytes, block_id: int) -> KVCacheBlock | None:
        entry = self._cache.get(key)
        if entry is None:
            return None
        if isinstance(entry, KVCacheBlock):
            if entry.block_id != block_id:
                return None
            del self._cache[key]
            return entry
        block = entry.pop(block_id, None)
        if len(entry) == 1:
            self._cache[key] = next(iter(entry.values()))
        return block

    def clear(self) -> None:
        self._cache.clear()


class BlockPool:
    """`num_blocks` blocks shared by every KV-cache group, with prefix caching."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
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

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[bytes],
        num_cached_blocks: int,
        num_full_blocks: int,
        group_id: int,
    ) -> None:
        """Cache `blocks[num_cached_blocks:num_full_blocks]` under `block_hashes` of the group.

        Null blocks (skipped positions) and blocks that already carry a hash are left alone.
        """
        if not self.enable_caching:
            return
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null or block.block_hash is not None:
                continue
            key = with_group_id(block_hashes[i], group_id)
            block.block_hash = key
            self.cached_block_hash_to_block.insert(key, block)

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        key = block.block_hash
        if key is None:
            return False
        block.block_hash = None
        self.cached_block_hash_to_block.pop(key, block.block_id)
        return True

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
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            if block.block_hash is not None:
                self._maybe_evict_cached_block(block)
            block.ref_cnt = 1
        return blocks

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
        for block in self.blocks:
            block.block_hash = None
        return True

    def get_usage(self) -> float:
        """Fraction of usable blocks (all but the null block) that are in use."""
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    def num_cached_blocks(self) -> int:
        return len(self.cached_block_hash_to_block)
