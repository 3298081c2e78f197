"""Paged K/V storage of attention layers."""

from __future__ import annotations

import attrs
import torch

from unified_attn.tensor_specs.base import KVCacheTensorSpec, as_dtype, typed_view
from unified_attn.utils import positive_int


@attrs.frozen
class PagedKVSpec(KVCacheTensorSpec):
    """K and V of `block_size` tokens per block.

    View: `[num_blocks, 2, block_size, num_kv_heads, head_size]` (index 0 = K, 1 = V), block
    stride = the shared `bytes_per_block`.
    """

    num_kv_heads: int = attrs.field(validator=positive_int)
    head_size: int = attrs.field(validator=positive_int)
    dtype: torch.dtype = attrs.field(converter=as_dtype)
    head_size_v: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.head_size_v is not None and self.head_size_v != self.head_size:
            raise ValueError(
                f"PagedKVSpec: head_size_v={self.head_size_v} differs from head_size="
                f"{self.head_size}; separate K/V head sizes are not supported yet "
                "(pad V to the K head size)."
            )

    def page_size_bytes(self, block_size: int) -> int:
        return 2 * block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize

    def make_view(
        self,
        buffer: torch.Tensor,
        offset: int,
        block_stride: int,
        num_blocks: int,
        block_size: int,
    ) -> torch.Tensor:
        shape = (2, block_size, self.num_kv_heads, self.head_size)
        return typed_view(buffer, self.dtype, offset, block_stride, num_blocks, shape)
