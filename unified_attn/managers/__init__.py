"""KV-cache managers with vLLM v1 semantics over one shared block pool.

The API: the per-group managers a backend names in its cache config (and that custom policies
subclass), and the scheduler-facing `KVCacheManager` with its configuration. The pool, its free
queue, hashing and the coordinators are internals: import them from their modules
(`managers.block_pool`, `managers.free_queue`, `managers.hashing`, `managers.coordinator`).
"""

from unified_attn.managers.base import SingleTypeKVCacheManager
from unified_attn.managers.chunked_local import ChunkedLocalAttentionManager
from unified_attn.managers.cross_attention import CrossAttentionManager
from unified_attn.managers.default_policy import default_paged_manager
from unified_attn.managers.full import FullAttentionManager
from unified_attn.managers.kv_cache_manager import KVCacheBlocks, KVCacheManager
from unified_attn.managers.scheduler_config import KVCacheGroup, SchedulerKVCacheConfig
from unified_attn.managers.sliding_window import SlidingWindowManager
from unified_attn.managers.state import MambaManager, StateManager
from unified_attn.managers.streaming_sink import StreamingSinkManager

__all__ = [
    "ChunkedLocalAttentionManager",
    "CrossAttentionManager",
    "FullAttentionManager",
    "KVCacheBlocks",
    "KVCacheGroup",
    "KVCacheManager",
    "MambaManager",
    "SchedulerKVCacheConfig",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "StateManager",
    "StreamingSinkManager",
    "default_paged_manager",
]
