"""The prefix-cache map: `hash + group id -> cached block(s)`, the index every lookup reads."""

from __future__ import annotations

from collections.abc import Iterable

from unified_attn.managers.free_queue import KVCacheBlock


class BlockHashToBlockMap:
    """`hash+group -> block`, allowing duplicates (two blocks may hold the same content).

    A single block is stored bare and becomes a `{block_id: block}` dict on the second insert.
    """

    def __init__(self) -> None:
        self._cache: dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]] = {}

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
