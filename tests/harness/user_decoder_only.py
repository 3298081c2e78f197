"""A custom backend that serves decoder layers only, as a model author declares it: through
`validate_configuration`'s reasons, so `check` reports the other attention types unsupported
(with the reason) instead of crashing their cells."""

from unified_attn.backend import AttentionType
from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.managers import SlidingWindowManager


class WindowOnlyDecoder(ReferenceAttentionBackend):
    name = "window-only-decoder"

    @classmethod
    def validate_configuration(cls, cfg):
        reasons = super().validate_configuration(cfg)
        if cfg.attn_type != AttentionType.DECODER:
            reasons.append(f"serves decoder layers only, not {cfg.attn_type.value}")
        return reasons

    def get_cache_config(self):
        _manager, config, spec = super().get_cache_config()  # decoder layers always have one
        if self.sliding_window is None or self.num_sink_tokens:
            return _manager, config, spec
        return SlidingWindowManager, SlidingWindowManager.Config(self.sliding_window), spec
