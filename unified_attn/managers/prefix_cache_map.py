"""The prefix-cache map: `hash + group id -> cached block(s)`, the index every lookup reads."""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from itertools import takewhile
from operator import is_, is_not
from typing import Any

from unified_attn.managers.free_queue import KVCacheBlock

_is_entry = partial(is_not, None)
_is_miss = partial(is_, None)


class BlockHashToBlockMap:
    """`hash+group -> block`, allowing duplicates (two blocks may hold the same content).

    A single block is stored bare and becomes a `{block_id: block}` dict on the second insert.
    """

    def __init__(self) -> None:
        self._cache: dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        # Keys holding a dict (duplicates): while 0, every entry is a bare block.
        self._num_shared_keys = 0

    def __len__(self) -> int:
        return len(self._cache)

    def __contains__(self, key: bytes) -> bool:
        return key in self._cache

    def blocks(self, key: bytes) -> Iterable[KVCacheBlock]:
        """Every block cached under `key` (duplicates included)."""
        entry = self._cache.get(key)
        if entry is None:
            return ()
        return (entry,) if isinstance(entry, KVCacheBlock) else tuple(entry.values())

    def get_one_block(self, key: bytes) -> KVCacheBlock | None:
        entry = self._cache.get(key)
        if entry is None or isinstance(entry, KVCacheBlock):
            return entry
        return next(iter(entry.values()))

    def first_blocks(self, keys: Iterable[bytes]) -> list[KVCacheBlock]:
        """`get_one_block` of each key in order, up to the first key with no block.

        The loop runs in C (`map`, `takewhile`): this is the prefix-hit scan.
        """
        # Bare blocks, or {block_id: block} dicts for keys with duplicates.
        entries: list[Any] = list(takewhile(_is_entry, map(self._cache.get, keys)))
        if self._num_shared_keys:
            return [e if isinstance(e, KVCacheBlock) else next(iter(e.values())) for e in entries]
        return entries

    def num_leading_misses(self, keys: Iterable[bytes]) -> int:
        """How many keys, from the first, have no block (one C loop, like `first_blocks`)."""
        return len(list(takewhile(_is_miss, map(self._cache.get, keys))))

    def insert(self, key: bytes, block: KVCacheBlock) -> None:
        entry = self._cache.get(key)
        if entry is None:
            self._cache[key] = block
        elif isinstance(entry, KVCacheBlock):
            self._cache[key] = {entry.block_id: entry, block.block_id: block}
            self._num_shared_keys += 1
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
            self._num_shared_keys -= 1
        return block

    def clear(self) -> None:
        self._cache.clear()
        self._num_shared_keys = 0
