"""unified_attn: one class per attention backend, worker-driven KV-cache allocation, and
KV-cache managers with vLLM v1 semantics."""

from unified_attn.managers import (
    BlockPool,
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    KVCacheGroup,
    KVCacheManager,
    SchedulerKVCacheConfig,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    StateManager,
    StreamingSinkManager,
)
from unified_attn.request import Request, RequestStatus
from unified_attn.runner.engine import EngineConfig, LLMEngine, RequestOutput
from unified_attn.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "BlockPool",
    "ChunkedLocalAttentionManager",
    "EngineConfig",
    "FullAttentionManager",
    "KVCacheGroup",
    "KVCacheManager",
    "LLMEngine",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "SchedulerKVCacheConfig",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "StateManager",
    "StreamingSinkManager",
    "__version__",
]
