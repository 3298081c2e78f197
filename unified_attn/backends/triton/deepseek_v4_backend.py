"""DeepSeek-V4 on the Triton kernels: the layer's attention over the `swa` window and the
selected compressed entries runs `gathered_attention_sets` (on an sm90 GPU one launch over both
sets of rows with the sinks in its softmax), each user's own partial softmax
`gathered_attention`, and the lightning indexer's scores `indexer_scores`. Only the seams
`attend_rows`, `attend_sets` and `score_entries` change: caches, managers, plans, checks, cache
writes, the indexer's top-k and the compressors are the reference backends'.
"""

from __future__ import annotations

from collections.abc import Mapping

from unified_attn.backend import AttentionBackend
from unified_attn.backends.deepseek_v4_compressed import (
    CompressedAttentionBackend,
    LightningIndexerBackend,
)
from unified_attn.backends.deepseek_v4_window import DeepseekV4WindowBackend
from unified_attn.backends.triton.indexer_ops import indexer_scores
from unified_attn.backends.triton.ops import platform_reasons
from unified_attn.backends.triton.v4_ops import gathered_attention, gathered_attention_sets
from unified_attn.selector import SelectorConfig, register_backend


class TritonCompressedAttentionBackend(CompressedAttentionBackend):
    """CSA/HCA's compressed entries through `gathered_attention`."""

    name = "triton-deepseek-v4-compressed"
    attend_rows = staticmethod(gathered_attention)


class TritonLightningIndexerBackend(LightningIndexerBackend):
    """CSA's lightning indexer with its scores from `indexer_scores`: no `[T, E, D]` keys are
    gathered, and each token's work stops at its own complete entries."""

    name = "triton-deepseek-v4-indexer"
    score_entries = staticmethod(indexer_scores)


@register_backend(priority={"cuda": 100})
class TritonDeepseekV4Backend(DeepseekV4WindowBackend):
    """The `swa` cache user on `gathered_attention` (each token's window of latents), with the
    Triton compressed-entry attention as the layer's `compressed` user."""

    name = "triton-deepseek-v4"
    attend_rows = staticmethod(gathered_attention)
    attend_sets = staticmethod(gathered_attention_sets)

    @classmethod
    def cache_user_classes(cls) -> Mapping[str, type[AttentionBackend]]:
        return {
            **super().cache_user_classes(),
            "compressed": TritonCompressedAttentionBackend,
            "indexer": TritonLightningIndexerBackend,
        }

    @classmethod
    def validate_configuration(cls, cfg: SelectorConfig) -> list[str]:
        reasons = super().validate_configuration(cfg)
        reasons += platform_reasons(cfg.device, cfg.dtype)
        if cfg.head_size < 16 or cfg.head_size & (cfg.head_size - 1):
            reasons.append(f"head size {cfg.head_size} is not a power of two >= 16")
        return reasons


__all__ = [
    "TritonCompressedAttentionBackend",
    "TritonDeepseekV4Backend",
    "TritonLightningIndexerBackend",
]
