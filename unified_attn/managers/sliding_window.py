"""Sliding-window attention: a query at position p sees keys in [p - W + 1, p].

Blocks whose tokens are all out of the window are recycled (replaced by the null block). A prefix
hit needs only the last W - 1 tokens before the hit boundary, so the search runs right to left
for `cdiv(W - 1, block_size)` contiguous cached blocks ending at the boundary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import islice

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

    Returns `[leading..., null..., run...]` and the hit length. When no run exists, the
    contiguous run of hits from block 0 still counts (short prompts).
    """
    bs, pool, group_id = manager.block_size, manager.block_pool, manager.group_id
    num_blocks = max_length // bs
    if num_blocks <= 0:
        return [], 0
    leading: list[KVCacheBlock] = []
    if num_leading:
        leading = pool.get_cached_prefix(
            islice(block_hashes, min(num_leading, num_blocks)), group_id
        )
    if len(leading) < num_leading:  # only the leading blocks before the miss can hit
        return _prefix_hit(leading, bs, alignment)
    need = manager.blocks_needed_for_hit()  # type: ignore[attr-defined]
    if need == 0:  # W == 1: no earlier token is ever read
        end = num_blocks * bs // alignment * alignment // bs
        blocks = [manager.null_block] * end
        blocks[:num_leading] = leading
        return blocks, end * bs
    found = _rightmost_run(manager, block_hashes, num_blocks, alignment, need, num_leading)
    if found is not None:
        start, run = found
        nulls = [manager.null_block] * (start - num_leading)
        return [*leading[:start], *nulls, *run], (start + len(run)) * bs
    rest = pool.get_cached_prefix(islice(block_hashes, num_leading, num_blocks), group_id)
    return _prefix_hit(leading + rest, bs, alignment)


def _rightmost_run(
    manager: SingleTypeKVCacheManager,
    block_hashes: Sequence[bytes],
    num_blocks: int,
    alignment: int,
    need: int,
    num_leading: int,
) -> tuple[int, list[KVCacheBlock]] | None:
    """The right-most run of cached blocks `[start, end)` with `end <= num_blocks` on an
    aligned boundary and `start = max(end - need, num_leading)` (at least one block), as
    `(start, run)`; None if there is none.

    On a miss at block m the next candidate `end` is the last aligned boundary at or before
    the first cached block left of m: every block is looked up at most once, each run of
    hits or misses in one C loop.
    """
    pool, group_id = manager.block_pool, manager.group_id
    step = alignment // math.gcd(alignment, manager.block_size)  # aligned iff step | end
    end = num_blocks // step * step
    while end > 0:
        start = min(max(end - need, num_leading), end - 1)
        run = pool.get_cached_prefix(reversed(block_hashes[start:end]), group_id)
        if len(run) == end - start:
            run.reverse()
            return start, run
        miss = end - len(run) - 1
        gap = pool.count_uncached_prefix(reversed(block_hashes[:miss]), group_id)
        end = (miss - gap) // step * step
    return None


def _prefix_hit(
    prefix: list[KVCacheBlock], block_size: int, alignment: int
) -> tuple[list[KVCacheBlock], int]:
    """The hit of a contiguous run of cached blocks from block 0, rounded down to `alignment`."""
    hit_length = len(prefix) * block_size // alignment * alignment
    return prefix[: hit_length // block_size], hit_length
