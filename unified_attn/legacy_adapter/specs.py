"""The legacy `KVCacheSpec` family: one frozen object bundles a layer's allocation policy (full,
window, chunk, state mode) with its layout (block size, heads, head size, dtype).

The unified contract splits the two (`LegacyBackendAdapter.get_cache_config`); these classes
exist so that four-class backends and their tests keep working unchanged.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs
import torch

from unified_attn.tensor_specs import as_dtype
from unified_attn.utils import optional_positive_int, positive_int


def _as_shapes(value: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(d) for d in shape) for shape in value)


def _as_dtypes(value: Any) -> tuple[torch.dtype, ...]:
    return tuple(as_dtype(d) for d in value)


@attrs.frozen(kw_only=True)
class KVCacheSpec:
    """The format of one layer's KV cache, `block_size` tokens per block."""

    block_size: int = attrs.field(validator=positive_int)

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError


@attrs.frozen(kw_only=True)
class AttentionSpec(KVCacheSpec):
    """K and V of `block_size` tokens: `2 * block_size * num_kv_heads * head_size` items."""

    num_kv_heads: int = attrs.field(validator=positive_int)
    head_size: int = attrs.field(validator=positive_int)
    dtype: torch.dtype = attrs.field(converter=as_dtype)

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize


@attrs.frozen(kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Every block is kept. A window or chunk here means "attend locally but keep everything"
    (vLLM promoted local layers to full attention when the hybrid allocator was off)."""

    sliding_window: int | None = attrs.field(default=None, validator=optional_positive_int)
    attention_chunk_size: int | None = attrs.field(default=None, validator=optional_positive_int)


@attrs.frozen(kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int = attrs.field(validator=positive_int)


@attrs.frozen(kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    attention_chunk_size: int = attrs.field(validator=positive_int)


@attrs.frozen(kw_only=True)
class MambaSpec(KVCacheSpec):
    """One recurrent state per block: tensors of `shapes[i]` and `dtypes[i]`."""

    shapes: tuple[tuple[int, ...], ...] = attrs.field(converter=_as_shapes)
    dtypes: tuple[torch.dtype, ...] = attrs.field(converter=_as_dtypes)
    mamba_cache_mode: Literal["none", "align"] = "none"
    num_speculative_blocks: int = 0

    @property
    def page_size_bytes(self) -> int:
        return sum(
            int(torch.Size(shape).numel()) * dtype.itemsize
            for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        )
