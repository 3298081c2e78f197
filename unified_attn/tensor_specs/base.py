"""`KVCacheTensorSpec`: one layer's storage per block, independent of how many blocks exist."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
    "int8": torch.int8,
}


def as_dtype(value: torch.dtype | str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    try:
        return _DTYPES[value]
    except KeyError:
        raise ValueError(f"unknown dtype {value!r}; use one of {sorted(_DTYPES)}") from None


def typed_view(
    buffer: torch.Tensor,
    dtype: torch.dtype,
    byte_offset: int,
    byte_block_stride: int,
    num_blocks: int,
    block_shape: tuple[int, ...],
) -> torch.Tensor:
    """A `[num_blocks, *block_shape]` view of `dtype` over a flat byte buffer.

    Block b starts at `byte_offset + b * byte_block_stride`; inside a block the elements are
    contiguous.
    """
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(
            f"the KV buffer must be a flat uint8 tensor, got {buffer.dtype} {tuple(buffer.shape)}"
        )
    item = dtype.itemsize
    if byte_offset % item or byte_block_stride % item:
        raise ValueError(
            f"offset {byte_offset} and block stride {byte_block_stride} must be multiples of "
            f"the {dtype} item size {item}"
        )
    numel = 1
    for dim in block_shape:
        numel *= dim
    end = byte_offset + (num_blocks - 1) * byte_block_stride + numel * item
    if num_blocks and end > buffer.numel():
        raise ValueError(f"the view needs {end} bytes but the buffer has {buffer.numel()}")
    elements = buffer.view(dtype)
    inner = []
    stride = 1
    for dim in reversed(block_shape):
        inner.append(stride)
        stride *= dim
    strides = (byte_block_stride // item, *reversed(inner))
    return elements.as_strided((num_blocks, *block_shape), strides, byte_offset // item)


class KVCacheTensorSpec(ABC):
    """Frozen value object: the bytes one layer needs per block and how to view them."""

    @abstractmethod
    def page_size_bytes(self, block_size: int) -> int:
        """Bytes of one block of this layer."""

    @abstractmethod
    def make_view(
        self,
        buffer: torch.Tensor,
        offset: int,
        block_stride: int,
        num_blocks: int,
        block_size: int,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The view a kernel indexes by physical block id (see the subclass for its shape)."""


class TypedKVSpec(KVCacheTensorSpec):
    """A spec whose block is one contiguous tensor of `dtype` (template method): a subclass
    states the tensor's shape, and the page size and the view follow from it.

    View: `[num_blocks, *block_shape(block_size)]`, block stride = the shared `bytes_per_block`
    (which may exceed this layer's page: the rest of the block belongs to other layers).
    """

    dtype: torch.dtype  # the subclass's attrs field

    @abstractmethod
    def block_shape(self, block_size: int) -> tuple[int, ...]:
        """The shape of one block's tensor."""

    def page_size_bytes(self, block_size: int) -> int:
        return math.prod(self.block_shape(block_size)) * self.dtype.itemsize

    def make_view(
        self,
        buffer: torch.Tensor,
        offset: int,
        block_stride: int,
        num_blocks: int,
        block_size: int,
    ) -> torch.Tensor:
        shape = self.block_shape(block_size)
        return typed_view(buffer, self.dtype, offset, block_stride, num_blocks, shape)
