"""Old four-class backends (Backend + MetadataBuilder + Metadata + Impl) under the one-class
contract: the legacy interfaces and KV-cache specs, `LegacyBackendAdapter`, and two ports
(`unified_attn.legacy_adapter.ports`). Importing it registers the adapter with the backend
registry: wherever a backend is named, a four-class backend class is wrapped."""

from unified_attn.legacy_adapter.adapter import LegacyBackendAdapter, adapt_legacy_class
from unified_attn.legacy_adapter.interfaces import (
    LegacyAttentionBackend,
    LegacyAttentionImpl,
    LegacyAttentionLayer,
    LegacyAttentionMetadata,
    LegacyAttentionMetadataBuilder,
    LegacyCommonAttentionMetadata,
)
from unified_attn.legacy_adapter.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from unified_attn.legacy_adapter.split import split_spec
from unified_attn.selector import register_class_adapter

register_class_adapter(adapt_legacy_class)

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
    "split_spec",
]
