"""unified_attn: one class per attention backend, worker-driven KV-cache allocation, and
KV-cache managers with vLLM v1 semantics.

The public API, by who uses it:

- **Running models**: `LLM` (vLLM's offline interface, docs/vllm-api.md), `LLMEngine`,
  `EngineConfig`, `SamplingParams`, and the outputs `RequestOutput`, `CompletionOutput`,
  `Logprob`, `StreamDelta` and `EncodeOutput` (encoder-only models' hidden states).
- **Writing a backend** (the contract is on `AttentionBackend`): `AttentionBackend`,
  `AttentionType`, `LayerConfig`, `CommonAttentionMetadata`, `CacheConfig`, `register_backend`,
  `select_backend`, `SelectorConfig`, and the tensor specs `KVCacheTensorSpec`, `PagedKVSpec`,
  `StateSpec`. Four-class backends go through `unified_attn.legacy_adapter`.
- **Writing a KV-cache policy**: `SingleTypeKVCacheManager` and the managers to subclass
  (`FullAttentionManager`, `SlidingWindowManager`, `ChunkedLocalAttentionManager`,
  `StreamingSinkManager`, `StateManager`, `CrossAttentionManager`), and `KVCacheManager` with
  `SchedulerKVCacheConfig` and `Request` to drive a policy on its own.

Everything else is importable from its module (`unified_attn.managers.block_pool`,
`unified_attn.runner.scheduler`, ...) but is not part of the API.
"""

from unified_attn.backend import (
    AttentionBackend,
    AttentionType,
    CacheConfig,
    CommonAttentionMetadata,
    LayerConfig,
)
from unified_attn.engine.engine_config import EngineConfig
from unified_attn.engine.llm_engine import LLMEngine
from unified_attn.engine.outputs import (
    CompletionOutput,
    EncodeOutput,
    Logprob,
    RequestOutput,
    StreamDelta,
)
from unified_attn.llm import LLM
from unified_attn.managers import (
    ChunkedLocalAttentionManager,
    CrossAttentionManager,
    FullAttentionManager,
    KVCacheManager,
    SchedulerKVCacheConfig,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    StateManager,
    StreamingSinkManager,
)
from unified_attn.request import Request
from unified_attn.sampling_params import SamplingParams
from unified_attn.selector import SelectorConfig, register_backend, select_backend
from unified_attn.tensor_specs import KVCacheTensorSpec, PagedKVSpec, StateSpec

__version__ = "0.1.0"

# running models
__all__ = [
    "LLM",
    "CompletionOutput",
    "EncodeOutput",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StreamDelta",
    "__version__",
]
# writing a backend
__all__ += [
    "AttentionBackend",
    "AttentionType",
    "CacheConfig",
    "CommonAttentionMetadata",
    "KVCacheTensorSpec",
    "LayerConfig",
    "PagedKVSpec",
    "SelectorConfig",
    "StateSpec",
    "register_backend",
    "select_backend",
]
# writing a KV-cache policy
__all__ += [
    "ChunkedLocalAttentionManager",
    "CrossAttentionManager",
    "FullAttentionManager",
    "KVCacheManager",
    "Request",
    "SchedulerKVCacheConfig",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "StateManager",
    "StreamingSinkManager",
]
