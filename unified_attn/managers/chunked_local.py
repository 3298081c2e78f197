"""Chunked local attention (Llama-4 style): a query sees keys of its own chunk only."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from unified_attn.managers.base import SingleTypeKVCacheManager, cdiv, check_positive
from unified_attn.managers.block_pool import KVCacheBlock


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    @attrs.frozen
    class Config(SingleTypeKVCacheManager.Config):
        attention_chunk_size: int = attrs.field(validator=check_positive)

    config: Config

    @property
    def chunk(self) -> int:
        return self.config.attention_chunk_size

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.chunk * self.chunk

    def max_blocks_per_request(self) -> int:
        span = min(self.chunk + self.max_in_flight_tokens, self.max_model_len)
        # A chunk that does not start on a block boundary straddles one more block.
        return cdiv(span, self.block_size) + (1 if self.chunk % self.block_size else 0)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int, alignment: int
    ) -> tuple[list[KVCacheBlock], int]:
        # Blocks before the current chunk are never read again: they count as computed (null).
        # Blocks inside the current chunk must hit left to right.
        first = max_length // self.chunk * self.chunk // self.block_size
        blocks = [self.null_block] * first
        group = (self.group_id,)
        for block_hash in block_hashes[first : max_length // self.block_size]:
            cached = self.block_pool.get_cached_block(block_hash, group)
            if cached is None:
                break
            blocks.append(cached[0])
        hit_length = len(blocks) * self.block_size // alignment * alignment
        return blocks[: hit_length // self.block_size], hit_length
