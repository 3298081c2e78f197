"""Full attention: every token stays visible, so no block is freed before the request ends."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

import attrs

from unified_attn.managers.base import SingleTypeKVCacheManager
from unified_attn.managers.block_pool import KVCacheBlock
from unified_attn.utils import cdiv


class FullAttentionManager(SingleTypeKVCacheManager):
    """Every token stays readable: no block is freed before the request ends, and a prefix hit
    is the longest run of cached blocks from the start."""

    @attrs.frozen
    class Config(SingleTypeKVCacheManager.Config):
        pass

    hit_is_downward_closed = True
    hit_needs_whole_prefix = True
    frees_blocks_early = False

    def max_blocks_per_request(self) -> int:
        return cdiv(self.max_model_len, self.block_size)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int, alignment: int
    ) -> tuple[list[KVCacheBlock], int]:
        # Hashes are chained: the first miss ends the hit, so scan left to right.
        num_blocks = max(max_length // self.block_size, 0)
        hits = self.block_pool.get_cached_prefix(islice(block_hashes, num_blocks), self.group_id)
        hit_length = len(hits) * self.block_size // alignment * alignment
        del hits[hit_length // self.block_size :]
        return hits, hit_length
