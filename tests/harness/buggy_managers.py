"""KV-cache policies with one planted bug each, returned by backends as a model author would
(the manager conformance of `check` must fail every one, naming the manager)."""

from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.managers import FullAttentionManager, SlidingWindowManager


class FreesInsideTheWindow(SlidingWindowManager):
    """Frees one block more than the window allows: its last block is still read."""

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return super().get_num_skipped_tokens(num_computed_tokens) + self.block_size


class DropsAHitBlock(FullAttentionManager):
    """A prefix hit of two blocks or more comes back with its first block replaced by the
    null block (whose contents are not the prefix's)."""

    def find_longest_cache_hit(self, block_hashes, max_length, alignment):
        blocks, length = super().find_longest_cache_hit(block_hashes, max_length, alignment)
        if len(blocks) >= 2:
            blocks = [self.block_pool.null_block, *blocks[1:]]
        return blocks, length


class UnderstatesItsCap(SlidingWindowManager):
    """Tells the scheduler and memory sizing two blocks fewer than a request holds."""

    def max_blocks_per_request(self) -> int:
        return super().max_blocks_per_request() - 2


def backend_with(manager, *, window_only: bool):
    """A reference backend whose window layers (or every decoder layer) use `manager`."""

    class Backend(ReferenceAttentionBackend):
        name = f"reference-{manager.__name__}"

        def get_cache_config(self):
            cache = super().get_cache_config()
            windowed = self.sliding_window is not None and not self.num_sink_tokens
            if cache is None or (window_only and not windowed):
                return cache
            _manager, config, spec = cache
            if not window_only:
                config = manager.Config()
            return manager, config, spec

    Backend.__name__ = Backend.__qualname__ = f"{manager.__name__}Backend"
    return Backend


FreesInsideTheWindowBackend = backend_with(FreesInsideTheWindow, window_only=True)
DropsAHitBlockBackend = backend_with(DropsAHitBlock, window_only=False)
UnderstatesItsCapBackend = backend_with(UnderstatesItsCap, window_only=True)
