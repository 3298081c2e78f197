"""Cross-attention: the encoder's keys and values of each request, read by the decoder.

A request's cross blocks cover its encoder tokens: `cdiv(num_encoder_tokens, block_size)`
blocks, allocated in full when it is admitted, kept until it finishes or is preempted, never
freed early and never prefix-cached (they depend on the whole encoder input, which the decoder
block hashes already fingerprint). The runner runs the encoder in the step a request is
admitted and writes its keys and values into these blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from unified_attn.managers.base import SingleTypeKVCacheManager
from unified_attn.managers.block_pool import KVCacheBlock
from unified_attn.request import Request
from unified_attn.utils import cdiv, positive_int


class CrossAttentionManager(SingleTypeKVCacheManager):
    """Blocks for each request's encoder tokens, allocated once at admission, freed at the end.

    `max_encoder_len` (the longest encoder input) sizes the worst case."""

    @attrs.frozen
    class Config(SingleTypeKVCacheManager.Config):
        max_encoder_len: int = attrs.field(validator=positive_int)

    config: Config
    frees_blocks_early = False
    takes_prefix_hits = False

    def tokens_to_hold(self, num_tokens: int, num_encoder_tokens: int) -> int:
        return num_encoder_tokens

    def max_blocks_per_request(self) -> int:
        return cdiv(self.config.max_encoder_len, self.block_size)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int, alignment: int
    ) -> tuple[list[KVCacheBlock], int]:
        """Never a hit: the coordinator does not ask this group (`takes_prefix_hits`)."""
        return [], 0

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Cross blocks are never cached."""
