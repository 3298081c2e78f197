"""unified_attn: one class per attention backend, worker-driven KV-cache allocation, and
KV-cache managers with vLLM v1 semantics."""

from unified_attn.managers import (
    BlockPool,
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    KVCacheGroup,
    KVCacheManager,
    MambaManager,
    SchedulerKVCacheConfig,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    StreamingSinkManager,
)
from unified_attn.request import Request, RequestStatus

__version__ = "0.1.0"

__all__ = [
    "BlockPool",
    "ChunkedLocalAttentionManager",
    "FullAttentionManager",
    "KVCacheGroup",
    "KVCacheManager",
    "MambaManager",
    "Request",
    "RequestStatus",
    "SchedulerKVCacheConfig",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "StreamingSinkManager",
    "__version__",
]
