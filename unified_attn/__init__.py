"""unified_attn: one class per attention backend, worker-driven KV-cache allocation, and
KV-cache managers with vLLM v1 semantics.

The public API is short, in three groups:

- **Run a model**: `LLM` (vLLM's offline interface, docs/vllm-api.md), `LLMEngine`,
  `SamplingParams`, and the outputs `RequestOutput` and `CompletionOutput`.
- **Write a backend** (the contract is `unified_attn.backend`): `AttentionBackend`,
  `LayerConfig`, `CommonAttentionMetadata`, `register_backend`.
- **Write a KV-cache policy**: `SingleTypeKVCacheManager` (subclass it, or a manager such as
  `SlidingWindowManager`), `PagedKVSpec` (the tensor spec a backend pairs with it) and
  `KVCacheManager` (to drive a policy on its own).

Everything else comes from its sub-package: the engine's `EngineConfig`, `Logprob`,
`StreamDelta` and `EncodeOutput` from `unified_attn.engine`; `AttentionType`, `CacheConfig`
and the cache-user protocols from `unified_attn.backend`; `select_backend`, `SelectorConfig`
and the backend registry from `unified_attn.selector`; the managers, `SchedulerKVCacheConfig`
from `unified_attn.managers`; `KVCacheTensorSpec`, `StateSpec` from
`unified_attn.tensor_specs`; `Request` from `unified_attn.request`; model families from
`unified_attn.models.families`.
"""

from typing import TYPE_CHECKING, Any

from unified_attn.backend import AttentionBackend, CommonAttentionMetadata, LayerConfig
from unified_attn.engine.outputs import CompletionOutput, RequestOutput
from unified_attn.managers import KVCacheManager, SingleTypeKVCacheManager, SlidingWindowManager
from unified_attn.sampling_params import SamplingParams
from unified_attn.selector import register_backend
from unified_attn.tensor_specs import PagedKVSpec

if TYPE_CHECKING:
    from unified_attn.engine.llm_engine import LLMEngine
    from unified_attn.llm import LLM


def __getattr__(name: str) -> Any:
    """`LLM` and `LLMEngine` load on first use: they bring in the models and their Triton
    kernels, which decide at import whether they run in Triton's interpreter, so a command can
    choose that first (`unified_attn.cli`)."""
    if name == "LLM":
        from unified_attn.llm import LLM

        return LLM
    if name == "LLMEngine":
        from unified_attn.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'unified_attn' has no attribute {name!r}")

__version__ = "0.1.0"

# run a model
__all__ = ["LLM", "CompletionOutput", "LLMEngine", "RequestOutput", "SamplingParams", "__version__"]
# write a backend
__all__ += ["AttentionBackend", "CommonAttentionMetadata", "LayerConfig", "register_backend"]
# write a KV-cache policy
__all__ += ["KVCacheManager", "PagedKVSpec", "SingleTypeKVCacheManager", "SlidingWindowManager"]
