"""docs/custom-managers.md's policy as a model author writes it in a module of their own: the
StreamingLLM manager (sink blocks kept, the window's kept, the middle freed) and the reference
backend subclass that returns it for window layers. `unified-attn check` must pass it."""

import attrs

from unified_attn import SingleTypeKVCacheManager, SlidingWindowManager
from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.managers.sliding_window import find_window_run
from unified_attn.utils import cdiv, non_negative_int, positive_int


class SinkAndWindowManager(SlidingWindowManager):
    @attrs.frozen
    class Config(SingleTypeKVCacheManager.Config):
        num_sink_tokens: int = attrs.field(validator=non_negative_int)
        sliding_window: int = attrs.field(validator=positive_int)

    def first_freeable_block(self) -> int:  # sink blocks are never freed
        return cdiv(self.config.num_sink_tokens, self.block_size)

    def max_blocks_per_request(self) -> int:  # sinks + the window cap
        return self.first_freeable_block() + super().max_blocks_per_request()

    def find_longest_cache_hit(self, block_hashes, max_length, alignment):
        # a hit needs the sink blocks plus a window run ending at the hit boundary
        leading = self.first_freeable_block()
        return find_window_run(self, block_hashes, max_length, alignment, num_leading=leading)


class SinkAndWindowReference(ReferenceAttentionBackend):
    name = "reference-sink-and-window"

    def get_cache_config(self):
        cache = super().get_cache_config()  # None for layers that keep no cache (encoders)
        if cache is None or self.sliding_window is None:  # only window layers get the policy
            return cache
        _manager, _config, spec = cache  # keep the paged K/V layout
        config = SinkAndWindowManager.Config(self.num_sink_tokens, self.sliding_window)
        return SinkAndWindowManager, config, spec
