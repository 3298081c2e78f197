"""Chunked local attention (Llama-4 style): a query sees keys of its own chunk only."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from unified_attn.managers.base import SingleTypeKVCacheManager
from unified_attn.managers.block_pool import KVCacheBlock
from unified_attn.utils import cdiv, positive_int


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """A query reads only keys of its own chunk of `attention_chunk_size` tokens: blocks of
    earlier chunks are freed, and a prefix hit needs only the blocks of the current chunk."""

    @attrs.frozen
    class Config(SingleTypeKVCacheManager.Config):
        attention_chunk_size: int = attrs.field(validator=positive_int)

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
        """Hit h is valid when every block overlapping `[chunk_start(h), h)` is cached; blocks
        entirely before the chunk of h are never read again and count as computed (null)."""
        bs, group = self.block_size, (self.group_id,)
        cached: dict[int, KVCacheBlock | None] = {}

        def lookup(i: int) -> KVCacheBlock | None:
            if i not in cached:
                hit = self.block_pool.get_cached_block(block_hashes[i], group)
                cached[i] = hit[0] if hit else None
            return cached[i]

        end = max_length // bs  # candidate hit, in blocks
        while end > 0:
            if end * bs % alignment:
                end -= 1
                continue
            start = end * bs // self.chunk * self.chunk // bs
            miss = next((i for i in range(end - 1, start - 1, -1) if lookup(i) is None), None)
            if miss is None:
                blocks = [self.null_block] * start + [cached[i] for i in range(start, end)]
                return blocks, end * bs  # type: ignore[return-value]
            end = miss  # every longer candidate still needs the missing block
        return [], 0
