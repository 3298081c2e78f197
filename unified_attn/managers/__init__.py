"""KV-cache managers with vLLM v1 semantics over one shared block pool."""

from unified_attn.managers.base import SingleTypeKVCacheManager
from unified_attn.managers.block_pool import BlockPool, PrefixCacheStats
from unified_attn.managers.chunked_local import ChunkedLocalAttentionManager
from unified_attn.managers.config import KVCacheGroup, SchedulerKVCacheConfig
from unified_attn.managers.coordinator import (
    HybridCoordinator,
    KVCacheCoordinator,
    NoPrefixCacheCoordinator,
    UnitaryCoordinator,
    make_coordinator,
)
from unified_attn.managers.free_queue import FreeKVCacheBlockQueue, KVCacheBlock
from unified_attn.managers.full import FullAttentionManager
from unified_attn.managers.hashing import (
    BlockHash,
    BlockHashWithGroupId,
    hash_block_tokens,
    request_block_hasher,
)
from unified_attn.managers.kv_cache_manager import KVCacheBlocks, KVCacheManager
from unified_attn.managers.sliding_window import SlidingWindowManager
from unified_attn.managers.state import MambaManager, StateManager
from unified_attn.managers.streaming_sink import StreamingSinkManager

__all__ = [
    "BlockHash",
    "BlockHashWithGroupId",
    "BlockPool",
    "ChunkedLocalAttentionManager",
    "FreeKVCacheBlockQueue",
    "FullAttentionManager",
    "HybridCoordinator",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheCoordinator",
    "KVCacheGroup",
    "KVCacheManager",
    "MambaManager",
    "NoPrefixCacheCoordinator",
    "PrefixCacheStats",
    "SchedulerKVCacheConfig",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "StateManager",
    "StreamingSinkManager",
    "UnitaryCoordinator",
    "hash_block_tokens",
    "make_coordinator",
    "request_block_hasher",
]
