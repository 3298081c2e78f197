"""KV-cache tensor specs: page bytes per layer and strided views over one flat byte buffer."""

from unified_attn.tensor_specs.base import KVCacheTensorSpec, TypedKVSpec, as_dtype, typed_view
from unified_attn.tensor_specs.latent import CompressedLatentSpec, LatentKVSpec
from unified_attn.tensor_specs.paged import PagedKVSpec
from unified_attn.tensor_specs.state_spec import StateSpec

__all__ = [
    "CompressedLatentSpec",
    "KVCacheTensorSpec",
    "LatentKVSpec",
    "PagedKVSpec",
    "StateSpec",
    "TypedKVSpec",
    "as_dtype",
    "typed_view",
]
