"""Fixed-size recurrent state per block (Mamba, linear attention)."""

from __future__ import annotations

import math

import attrs
import torch

from unified_attn.tensor_specs.base import KVCacheTensorSpec, as_dtype, typed_view
from unified_attn.utils import cdiv


def _as_shapes(value) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(d) for d in shape) for shape in value)


def _as_dtypes(value) -> tuple[torch.dtype, ...]:
    return tuple(as_dtype(d) for d in value)


@attrs.frozen
class StateSpec(KVCacheTensorSpec):
    """One state per block: tensors of `shapes[i]` and `dtypes[i]`, packed in order.

    View: a tuple with one `[num_blocks, *shapes[i]]` tensor per state tensor. The state does not
    grow with tokens, so the page size does not depend on `block_size`.
    """

    shapes: tuple[tuple[int, ...], ...] = attrs.field(converter=_as_shapes)
    dtypes: tuple[torch.dtype, ...] = attrs.field(converter=_as_dtypes)

    def __attrs_post_init__(self) -> None:
        if not self.shapes or len(self.shapes) != len(self.dtypes):
            raise ValueError(
                f"StateSpec needs one dtype per shape and at least one shape, got "
                f"{len(self.shapes)} shapes and {len(self.dtypes)} dtypes"
            )
        for shape in self.shapes:
            if any(d <= 0 for d in shape):
                raise ValueError(f"StateSpec: every dimension must be positive, got {shape}")

    def _offsets(self) -> list[int]:
        offsets, pos = [], 0
        for shape, dtype in zip(self.shapes, self.dtypes, strict=True):
            pos = cdiv(pos, dtype.itemsize) * dtype.itemsize  # align each tensor to its item size
            offsets.append(pos)
            pos += math.prod(shape) * dtype.itemsize
        offsets.append(pos)
        return offsets

    def page_size_bytes(self, block_size: int) -> int:
        return self._offsets()[-1]

    def make_view(
        self,
        buffer: torch.Tensor,
        offset: int,
        block_stride: int,
        num_blocks: int,
        block_size: int,
    ) -> tuple[torch.Tensor, ...]:
        offsets = self._offsets()
        return tuple(
            typed_view(buffer, dtype, offset + off, block_stride, num_blocks, shape)
            for shape, dtype, off in zip(self.shapes, self.dtypes, offsets, strict=False)
        )
