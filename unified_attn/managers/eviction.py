"""Window-aware eviction: cached free blocks that no prefix hit can use go before the least
recently used blocks that still can.

A cached block is **dead** when no lookup can return it with the cache as it is now. Two rules,
both about whole-prefix groups (full attention: a hit of L tokens needs every block before L):

* chain rule: a block of a whole-prefix group whose parent (the group's block just before it,
  same chain) is no longer cached is dead: hits run left to right and stop at the parent;
* twin rule: a block of any other group is dead when the whole-prefix group's block that ends
  at the same token (same hash) is no longer cached: every hit using the block covers that
  token. It applies when the group's block size is a multiple of the whole-prefix group's.

Deadness is checked lazily. When a key leaves the prefix cache, its chain children and twins
that sit in the free queue become *suspects*; when a block is needed, a suspect is taken only
after the rules confirm, at that moment, that it is dead. A suspect that was hit, reused or
revived (its parent was cached again) is dropped, so nothing has to be undone on the hot paths.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Literal

import attrs

from unified_attn.managers.free_queue import FreeKVCacheBlockQueue, KVCacheBlock
from unified_attn.managers.prefix_cache_map import BlockHashToBlockMap
from unified_attn.utils import positive_int

EvictionPolicy = Literal["lru", "window_aware"]
EVICTION_POLICIES: tuple[EvictionPolicy, ...] = ("lru", "window_aware")


def check_eviction(value: str) -> EvictionPolicy:
    if value not in EVICTION_POLICIES:
        raise ValueError(
            f"eviction must be one of {EVICTION_POLICIES}, got {value!r}; 'lru' is vLLM's "
            "order, 'window_aware' evicts blocks no prefix hit can use first"
        )
    return value


@attrs.frozen
class GroupLayout:
    """What window-aware eviction knows of a KV-cache group: its block size, and whether a hit
    of L tokens needs every one of its blocks before L (full attention)."""

    block_size: int = attrs.field(validator=positive_int)
    whole_prefix: bool = False


class DeadBlockFinder:
    """Suspects and verdicts over one pool's prefix-cache map (see the module docstring).

    For blocks of whole-prefix groups, each cached block keeps its parent's key
    (`KVCacheBlock.parent_block_hash`) and `children` indexes the reverse, so that the children
    of a key that leaves the cache can be found.
    """

    def __init__(
        self, cache: BlockHashToBlockMap, layouts: Sequence[GroupLayout], num_blocks: int
    ) -> None:
        self.cache = cache
        # Keys end with the 4-byte group id (`hashing.with_group_id`): groups are compared by
        # that suffix, so no key is split on the hot paths.
        tails = [_tail(g) for g in range(len(layouts))]
        chained = [g for g, layout in enumerate(layouts) if layout.whole_prefix]
        self.chained_tails = frozenset(tails[f] for f in chained)
        # backers[tail of g]: tails of the whole-prefix groups whose blocks end wherever a
        # block of g ends; backed[tail of f]: the groups f backs (the reverse).
        self.backers: dict[bytes, tuple[bytes, ...]] = {}
        self.backed: dict[bytes, list[bytes]] = {tails[f]: [] for f in chained}
        for g, layout in enumerate(layouts):
            backers = [
                f for f in chained if f != g and layout.block_size % layouts[f].block_size == 0
            ]
            if backers:
                self.backers[tails[g]] = tuple(tails[f] for f in backers)
            for f in backers:
                self.backed[tails[f]].append(tails[g])
        # parent key -> child key, or {child key: None} for several (most have one child).
        self.children: dict[bytes, bytes | dict[bytes, None]] = {}
        self.suspects: deque[tuple[KVCacheBlock, bytes]] = deque()
        self.max_suspects = 2 * num_blocks
        self.num_dead_evicted = 0

    def is_chained(self, group_id: int) -> bool:
        return _tail(group_id) in self.chained_tails

    # ---- the cache changes -------------------------------------------------------------------

    def key_cached(self, block: KVCacheBlock, parent_key: bytes) -> None:
        """`block` of a whole-prefix group was cached (`block.block_hash`) after `parent_key`."""
        key = block.block_hash
        assert key is not None
        block.parent_block_hash = parent_key
        siblings = self.children.get(parent_key)
        if siblings is None:
            self.children[parent_key] = key
        elif isinstance(siblings, dict):
            siblings[key] = None
        elif siblings != key:
            self.children[parent_key] = {siblings: None, key: None}

    def key_uncached(self, key: bytes, parent_key: bytes | None) -> None:
        """The last block cached under `key` (after `parent_key`) lost its hash: its children
        and twins that are free become suspects."""
        tail = key[-4:]
        if tail not in self.chained_tails:
            return  # only whole-prefix groups make blocks dead
        if parent_key is not None:
            self._forget_child(parent_key, key)
        children = self.children.get(key)
        if children is not None:
            for child in (children,) if isinstance(children, bytes) else tuple(children):
                self._suspect(child)
        block_hash = key[:-4]
        for twin_tail in self.backed[tail]:
            self._suspect(block_hash + twin_tail)

    def clear(self) -> None:
        self.children.clear()
        self.suspects.clear()

    def _forget_child(self, parent_key: bytes, key: bytes) -> None:
        siblings = self.children.get(parent_key)
        if siblings == key:
            del self.children[parent_key]
        elif isinstance(siblings, dict):
            siblings.pop(key, None)
            if len(siblings) == 1:
                self.children[parent_key] = next(iter(siblings))

    # ---- verdicts ------------------------------------------------------------------------------

    def is_dead(self, block: KVCacheBlock) -> bool:
        """Whether no lookup can return a block cached under `block`'s key now (the rules)."""
        key = block.block_hash
        assert key is not None
        parent = block.parent_block_hash
        if parent is not None and parent not in self.cache:
            return True  # chain rule
        block_hash = key[:-4]
        for tail in self.backers.get(key[-4:], ()):  # noqa: SIM110 (no generator per eviction)
            if block_hash + tail not in self.cache:
                return True  # twin rule
        return False

    def pop_dead(self, queue: FreeKVCacheBlockQueue) -> KVCacheBlock | None:
        """Take a confirmed dead block out of the free queue, dropping stale suspects; None when
        no suspect is dead."""
        while self.suspects:
            block, key = self.suspects.popleft()
            if block.ref_cnt == 0 and block.block_hash == key and self.is_dead(block):
                queue.remove(block)
                self.num_dead_evicted += 1
                return block
        return None

    def _suspect(self, key: bytes) -> None:
        for block in self.cache.blocks(key):
            if block.ref_cnt == 0:
                self.suspects.append((block, key))
        if len(self.suspects) > self.max_suspects:
            self._drop_stale()

    def _drop_stale(self) -> None:
        """Forget suspects that were hit or reused since (keeps the deque within the pool)."""
        live: dict[int, tuple[KVCacheBlock, bytes]] = {}
        for block, key in self.suspects:
            if block.ref_cnt == 0 and block.block_hash == key:
                live.setdefault(block.block_id, (block, key))
        self.suspects = deque(live.values())


def _tail(group_id: int) -> bytes:
    return group_id.to_bytes(4, "big")
