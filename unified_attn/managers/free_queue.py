"""`KVCacheBlock` and the free queue: an intrusive doubly linked list with O(1) operations."""

from __future__ import annotations

from collections.abc import Iterator, Sequence


class KVCacheBlock:
    """One block of the pool. `block_hash` is the prefix-cache key (hash + group id) while the
    block is full and cached; the `prev/next_free_block` links are owned by the free queue.
    `parent_block_hash` is the key of the block before it in its chain, kept only by
    window-aware eviction for full-attention groups."""

    __slots__ = (
        "block_hash",
        "block_id",
        "is_null",
        "next_free_block",
        "parent_block_hash",
        "prev_free_block",
        "ref_cnt",
    )

    def __init__(self, block_id: int, ref_cnt: int = 0, block_hash: bytes | None = None) -> None:
        self.block_id = block_id
        self.ref_cnt = ref_cnt
        self.block_hash = block_hash
        self.parent_block_hash: bytes | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        tag = " null" if self.is_null else ""
        hashed = " hashed" if self.block_hash is not None else ""
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}{hashed}{tag})"


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order (head first), linked through the blocks themselves.

    Head and tail sentinels remove every edge case; no Python list is rebuilt per operation.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        prev = self.head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.tail
        self.tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        first = self.head.next_free_block
        if first is self.tail or first is None:
            raise ValueError("No free blocks available")
        self._unlink(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} blocks: only {self.num_free_blocks} are free")
        out = []
        block = self.head.next_free_block
        for _ in range(n):
            assert block is not None
            out.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        self.head.next_free_block = block
        assert block is not None
        block.prev_free_block = self.head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is None or block.next_free_block is None:
            raise RuntimeError(f"remove: block {block.block_id} is not in the free queue")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._link_after(self.tail.prev_free_block, blocks)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put `blocks` at the head, keeping their given order."""
        self._link_after(self.head, blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        return list(self)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self.head.next_free_block
        while block is not None and block is not self.tail:
            yield block
            block = block.next_free_block

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        assert prev is not None and nxt is not None
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def _link_after(self, anchor: KVCacheBlock | None, blocks: Sequence[KVCacheBlock]) -> None:
        if not blocks:
            return
        assert anchor is not None
        after = anchor.next_free_block
        assert after is not None
        prev = anchor
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = after
        after.prev_free_block = prev
        self.num_free_blocks += len(blocks)
