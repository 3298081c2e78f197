"""Sliding-window attention: a query at position p sees keys in [p - W + 1, p].

Blocks whose tokens are all out of the window are recycled (replaced by the null block). A prefix
hit needs only the last W - 1 tokens before the hit boundary, so the search runs right to left
for `cdiv(W - 1, block_size)` contiguous cached blocks ending at the boundary.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from unified_attn.managers.base import SingleTypeKVCacheManager
from unified_attn.managers.block_pool import KVCacheBlock
from unified_attn.utils import cdiv, positive_int


class SlidingWindowManager(SingleTypeKVCacheManager):
    """A query at position p reads keys `[p - sliding_window + 1, p]`: blocks wholly before the
    window are freed (their table entries become the null block), and a prefix hit is the
    right-most run of cached blocks that covers a window, not the whole prefix."""

    @attrs.frozen
    class Config(SingleTypeKVCacheManager.Config):
        sliding_window: int = attrs.field(validator=positive_int)

    config: Config

    @property
    def window(self) -> int:
        return self.config.sliding_window

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.window + 1)

    def max_blocks_per_request(self) -> int:
        # +1: the window need not start on a block boundary.
        span = min(self.window - 1 + self.max_in_flight_tokens, self.max_model_len)
        return cdiv(span, self.block_size) + 1

    def blocks_needed_for_hit(self) -> int:
        return cdiv(self.window - 1, self.block_size)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int, alignment: int
    ) -> tuple[list[KVCacheBlock], int]:
        return find_window_run(self, block_hashes, max_length, alignment, num_leading=0)


def find_window_run(
    manager: SingleTypeKVCacheManager,
    block_hashes: Sequence[bytes],
    max_length: int,
    alignment: int,
    num_leading: int,
) -> tuple[list[KVCacheBlock], int]:
    """Right-to-left search for a window run; `num_leading` blocks must also hit (sinks).

    Returns `[leading..., null..., run...]` and the hit length. When no full run exists, the
    contiguous run of hits from block 0 still counts (short prompts).
    """
    bs = manager.block_size
    need = manager.blocks_needed_for_hit()  # type: ignore[attr-defined]
    pool, group = manager.block_pool, (manager.group_id,)
    num_blocks = max_length // bs
    cached: list[KVCacheBlock | None] = [None] * num_blocks

    def lookup(i: int) -> KVCacheBlock | None:
        if cached[i] is None:
            hit = pool.get_cached_block(block_hashes[i], group)
            cached[i] = hit[0] if hit else None
        return cached[i]

    leading = 0
    while leading < min(num_leading, num_blocks) and lookup(leading) is not None:
        leading += 1
    if leading == num_leading and need == 0:  # W == 1: no earlier token is ever read
        end = num_blocks * bs // alignment * alignment // bs
        blocks = [manager.null_block] * end
        blocks[:leading] = cached[:leading]  # type: ignore[assignment]
        return blocks, end * bs
    if leading == num_leading:
        run = 0
        for i in range(num_blocks - 1, -1, -1):
            if lookup(i) is None:
                run = 0
                continue
            if run == 0 and (i + 1) * bs % alignment:
                continue  # a run must end on an aligned boundary
            run += 1
            if run >= need or i <= num_leading:
                end = i + run
                blocks = [manager.null_block] * end
                for j in [*range(num_leading), *range(i, end)]:
                    blocks[j] = cached[j]
                return blocks, end * bs
    # No run: the contiguous prefix from block 0 is a valid hit on its own.
    while leading < num_blocks and lookup(leading) is not None:
        leading += 1
    hit_length = leading * bs // alignment * alignment
    return [b for b in cached[: hit_length // bs] if b is not None], hit_length
