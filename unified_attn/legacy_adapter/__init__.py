"""Old four-class backends (Backend + MetadataBuilder + Metadata + Impl) under the one-class
contract: the legacy interfaces and KV-cache specs, `LegacyBackendAdapter`, and two ports
(`unified_attn.legacy_adapter.ports`)."""

from unified_attn.legacy_adapter.adapter import LegacyBackendAdapter
from unified_attn.legacy_adapter.interfaces import (
    LegacyAttentionBackend,
    LegacyAttentionImpl,
    LegacyAttentionLayer,
    LegacyAttentionMetadata,
    LegacyAttentionMetadataBuilder,
    LegacyCommonAttentionMetadata,
)
from unified_attn.legacy_adapter.resolve import resolve_any_backend
from unified_attn.legacy_adapter.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from unified_attn.legacy_adapter.split import split_spec

__all__ = [
    "AttentionSpec",
    "ChunkedLocalAttentionSpec",
    "FullAttentionSpec",
    "KVCacheSpec",
    "LegacyAttentionBackend",
    "LegacyAttentionImpl",
    "LegacyAttentionLayer",
    "LegacyAttentionMetadata",
    "LegacyAttentionMetadataBuilder",
    "LegacyBackendAdapter",
    "LegacyCommonAttentionMetadata",
    "MambaSpec",
    "SlidingWindowSpec",
    "resolve_any_backend",
    "split_spec",
]
