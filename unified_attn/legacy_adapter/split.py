"""Legacy spec -> `(manager_cls, config, tensor spec)`: the project's only spec-to-manager table.

A legacy spec carries policy and layout together. The policy becomes a manager `Config`, the
layout a `KVCacheTensorSpec`, and the block size is dropped: the worker chooses it now.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unified_attn.backend import CacheConfig
from unified_attn.legacy_adapter.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from unified_attn.managers import (
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    SlidingWindowManager,
    StateManager,
)
from unified_attn.tensor_specs import PagedKVSpec, StateSpec


def _full(spec: Any) -> CacheConfig:
    return FullAttentionManager, FullAttentionManager.Config(), _paged(spec)


def _sliding(spec: Any) -> CacheConfig:
    config = SlidingWindowManager.Config(sliding_window=spec.sliding_window)
    return SlidingWindowManager, config, _paged(spec)


def _chunked(spec: Any) -> CacheConfig:
    config = ChunkedLocalAttentionManager.Config(attention_chunk_size=spec.attention_chunk_size)
    return ChunkedLocalAttentionManager, config, _paged(spec)


def _mamba(spec: Any) -> CacheConfig:
    config = StateManager.Config(
        mamba_cache_mode=spec.mamba_cache_mode, num_speculative_blocks=spec.num_speculative_blocks
    )
    return StateManager, config, StateSpec(spec.shapes, spec.dtypes)


def _paged(spec: AttentionSpec) -> PagedKVSpec:
    return PagedKVSpec(spec.num_kv_heads, spec.head_size, spec.dtype)


# Exact types, most specific first: a subclass of a legacy spec is not silently treated as its
# parent (vLLM's registry walked the MRO; a custom spec here must be split by its own backend).
SPEC_TO_MANAGER: dict[type[KVCacheSpec], Callable[[Any], CacheConfig]] = {
    FullAttentionSpec: _full,
    SlidingWindowSpec: _sliding,
    ChunkedLocalAttentionSpec: _chunked,
    MambaSpec: _mamba,
}


def split_spec(spec: KVCacheSpec) -> CacheConfig:
    """The unified triple of a legacy spec (see the module docstring)."""
    try:
        split = SPEC_TO_MANAGER[type(spec)]
    except KeyError:
        raise ValueError(
            f"no manager for legacy KV-cache spec {type(spec).__name__}; known specs: "
            f"{', '.join(t.__name__ for t in SPEC_TO_MANAGER)}. Port the backend to the unified "
            "contract and return its triple from get_cache_config instead."
        ) from None
    return split(spec)
