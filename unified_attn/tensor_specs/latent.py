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

from unified_attn.tensor_specs.base import TypedKVSpec, as_dtype
from unified_attn.utils import positive_int


def _as_dtype(value: torch.dtype | str) -> torch.dtype:
    try:
        return as_dtype(value)
    except (ValueError, TypeError) as error:
        raise ValueError(f"LatentKVSpec.dtype: {error}") from None


@attrs.frozen
class LatentKVSpec(TypedKVSpec):
    """`block_size` latent vectors of `head_size` values per block.

    View: `[num_blocks, block_size, head_size]` (see `TypedKVSpec` for the block stride).
    """

    head_size: int = attrs.field(validator=positive_int)
    dtype: torch.dtype = attrs.field(converter=_as_dtype)

    def block_shape(self, block_size: int) -> tuple[int, ...]:
        return (block_size, self.head_size)


@attrs.frozen
class CompressedLatentSpec(TypedKVSpec):
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

    def block_shape(self, block_size: int) -> tuple[int, ...]:
        return (self.entries_per_block(block_size), self.head_size)
