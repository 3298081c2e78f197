"""The default policy of a paged attention layer: which manager, with which config, holds its
K/V by what the layer attends to. `AttentionBackend.get_cache_config` uses it unless a backend
declares another manager."""

from __future__ import annotations

from typing import Any

from unified_attn.managers.base import SingleTypeKVCacheManager
from unified_attn.managers.chunked_local import ChunkedLocalAttentionManager
from unified_attn.managers.cross_attention import CrossAttentionManager
from unified_attn.managers.full import FullAttentionManager
from unified_attn.managers.sliding_window import SlidingWindowManager
from unified_attn.managers.streaming_sink import StreamingSinkManager


def default_paged_manager(
    *,
    sliding_window: int | None,
    num_sink_tokens: int,
    attention_chunk_size: int | None,
    max_encoder_len: int | None,
) -> tuple[type[SingleTypeKVCacheManager], Any]:
    """`(manager_cls, config)`: cross-attention (`max_encoder_len`: each request's encoder keys
    and values), StreamingLLM sinks + window, a sliding window, chunked local attention, else
    full attention."""
    if max_encoder_len is not None:
        return CrossAttentionManager, CrossAttentionManager.Config(max_encoder_len)
    if sliding_window is not None and num_sink_tokens:
        return StreamingSinkManager, StreamingSinkManager.Config(num_sink_tokens, sliding_window)
    if sliding_window is not None:
        return SlidingWindowManager, SlidingWindowManager.Config(sliding_window=sliding_window)
    if attention_chunk_size is not None:
        config = ChunkedLocalAttentionManager.Config(attention_chunk_size=attention_chunk_size)
        return ChunkedLocalAttentionManager, config
    return FullAttentionManager, FullAttentionManager.Config()
