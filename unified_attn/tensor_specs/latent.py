"""Latent storage of multi-head latent attention (MLA, DeepSeek-V2/V3): one vector per token.

An MLA layer caches, per token, the normalised compressed KV (`kv_lora_rank` values) followed by
the roped shared key part (`qk_rope_head_dim` values). The same vector is the key (all of it) and
the value (its first `kv_lora_rank` values) of every head, so there is no K/V pair and no head
dimension: `head_size = kv_lora_rank + qk_rope_head_dim` (576 for DeepSeek-V3).

`CompressedLatentSpec` stores one latent per `compress_rate` tokens instead (DeepSeek-V4's
compressed entries and indexer keys): a block of `block_size` tokens holds `block_size // rate`
of them.
"""

from __future__ import annotations

import attrs
import torch

from unified_attn.tensor_specs.base import KVCacheTensorSpec, as_dtype, typed_view
from unified_attn.utils import positive_int


def _as_dtype(value: torch.dtype | str) -> torch.dtype:
    try:
        return as_dtype(value)
    except (ValueError, TypeError) as error:
        raise ValueError(f"LatentKVSpec.dtype: {error}") from None


@attrs.frozen
class LatentKVSpec(KVCacheTensorSpec):
    """`block_size` latent vectors of `head_size` values per block.

    View: `[num_blocks, block_size, head_size]`, block stride = the shared `bytes_per_block`
    (which may exceed this layer's page: the rest of the block belongs to other layers).
    """

    head_size: int = attrs.field(validator=positive_int)
    dtype: torch.dtype = attrs.field(converter=_as_dtype)

    def page_size_bytes(self, block_size: int) -> int:
        return block_size * self.head_size * self.dtype.itemsize

    def make_view(
        self,
        buffer: torch.Tensor,
        offset: int,
        block_stride: int,
        num_blocks: int,
        block_size: int,
    ) -> torch.Tensor:
        shape = (block_size, self.head_size)
        return typed_view(buffer, self.dtype, offset, block_stride, num_blocks, shape)


@attrs.frozen
class CompressedLatentSpec(KVCacheTensorSpec):
    """One latent of `head_size` values per `compress_rate` tokens (DeepSeek-V4's compressed
    caches: CSA/HCA entries and lightning-indexer keys).

    Entry w summarises tokens `[w * rate, (w + 1) * rate)`; a block of `block_size` tokens holds
    the `block_size // rate` entries of its tokens, so `block_size` must be a multiple of the
    rate (`block_size_multiple`). View: `[num_blocks, block_size // rate, head_size]`; entry w of
    a request sits in its block `w * rate // block_size` at offset `(w * rate % block_size) //
    rate`.
    """

    head_size: int = attrs.field(validator=positive_int)
    compress_rate: int = attrs.field(validator=positive_int)
    dtype: torch.dtype = attrs.field(converter=_as_dtype)

    @property
    def block_size_multiple(self) -> int:
        return self.compress_rate

    def entries_per_block(self, block_size: int) -> int:
        if block_size % self.compress_rate:
            raise ValueError(
                f"CompressedLatentSpec: block_size={block_size} is not a multiple of "
                f"compress_rate={self.compress_rate}; a block must hold whole compressed entries, "
                f"so use a block size that is a multiple of {self.compress_rate}"
            )
        return block_size // self.compress_rate

    def page_size_bytes(self, block_size: int) -> int:
        return self.entries_per_block(block_size) * self.head_size * self.dtype.itemsize

    def make_view(
        self,
        buffer: torch.Tensor,
        offset: int,
        block_stride: int,
        num_blocks: int,
        block_size: int,
    ) -> torch.Tensor:
        shape = (self.entries_per_block(block_size), self.head_size)
        return typed_view(buffer, self.dtype, offset, block_stride, num_blocks, shape)
