"""StreamingLLM retention, written the way a model author writes a custom manager.

Keep the blocks holding the first `num_sink_tokens` tokens (attention sinks) and the blocks of the
sliding window; free everything in between. A prefix hit needs the sink blocks plus a window run
ending at the hit boundary. No table anywhere names this class: a backend returns it from
`get_cache_config()` and the coordinator instantiates it.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from unified_attn.managers.base import SingleTypeKVCacheManager
from unified_attn.managers.block_pool import KVCacheBlock
from unified_attn.managers.sliding_window import SlidingWindowManager, find_window_run
from unified_attn.utils import cdiv, non_negative_int, positive_int


class StreamingSinkManager(SlidingWindowManager):
    """StreamingLLM: the first `num_sink_tokens` tokens stay forever, plus a sliding window;
    the blocks between them are freed (see docs/custom-managers.md)."""

    @attrs.frozen
    class Config(SingleTypeKVCacheManager.Config):
        num_sink_tokens: int = attrs.field(validator=non_negative_int)
        sliding_window: int = attrs.field(validator=positive_int)

    config: Config  # type: ignore[assignment]

    def first_freeable_block(self) -> int:
        return cdiv(self.config.num_sink_tokens, self.block_size)

    def max_blocks_per_request(self) -> int:
        return self.first_freeable_block() + super().max_blocks_per_request()

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int, alignment: int
    ) -> tuple[list[KVCacheBlock], int]:
        sink_blocks = self.first_freeable_block()
        return find_window_run(self, block_hashes, max_length, alignment, num_leading=sink_blocks)
