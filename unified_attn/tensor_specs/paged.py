"""Paged K/V storage of attention layers, and the names of the KV-cache dtypes."""

from __future__ import annotations

import attrs
import torch

from unified_attn.tensor_specs.base import TypedKVSpec, as_dtype
from unified_attn.utils import positive_int

FP8_KV_DTYPE = torch.float8_e4m3fn  # what `kv_cache_dtype="fp8"` stores (vLLM's name)
# vLLM's names of the fp8 cache, besides the torch dtype names `as_dtype` knows.
FP8_KV_NAMES = ("fp8", "fp8_e4m3")
# What an engine's `kv_cache_dtype` may be: the model dtype, or fp8 e4m3 with per-layer scales.
ENGINE_KV_CACHE_DTYPES = ("auto", *FP8_KV_NAMES)


def as_kv_dtype(value: torch.dtype | str) -> torch.dtype:
    """A cache dtype: `fp8` / `fp8_e4m3` (float8 e4m3fn) or any dtype `as_dtype` knows."""
    if isinstance(value, str) and value in FP8_KV_NAMES:
        return FP8_KV_DTYPE
    return as_dtype(value)


def kv_cache_dtype_name(value: str) -> str:
    """An engine's `kv_cache_dtype` checked and spelled as backends take it: `auto`, or the
    torch name of the fp8 dtype (`float8_e4m3fn`). A `ValueError` for anything else."""
    if value not in ENGINE_KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={value!r} is not supported; use 'auto' (the model dtype) or 'fp8' "
            "(float8 e4m3 with per-layer scales: half the bytes of bfloat16, see "
            "docs/kv-cache.md)"
        )
    return value if value == "auto" else str(FP8_KV_DTYPE).removeprefix("torch.")


def is_fp8_kv(dtype: torch.dtype | str) -> bool:
    """True for the fp8 cache dtype under any of its names."""
    if isinstance(dtype, str) and dtype == "auto":
        return False
    try:
        return as_kv_dtype(dtype) == FP8_KV_DTYPE
    except ValueError:
        return False


@attrs.frozen
class PagedKVSpec(TypedKVSpec):
    """K and V of `block_size` tokens per block, in `dtype` (`fp8` for float8 e4m3: one byte
    per element, half the page of bfloat16).

    View: `[num_blocks, 2, block_size, num_kv_heads, head_size]` (index 0 = K, 1 = V; see
    `TypedKVSpec` for the block stride).
    """

    num_kv_heads: int = attrs.field(validator=positive_int)
    head_size: int = attrs.field(validator=positive_int)
    dtype: torch.dtype = attrs.field(converter=as_kv_dtype)
    head_size_v: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.head_size_v is not None and self.head_size_v != self.head_size:
            raise ValueError(
                f"PagedKVSpec: head_size_v={self.head_size_v} differs from head_size="
                f"{self.head_size}; separate K/V head sizes are not supported yet "
                "(pad V to the K head size)."
            )

    def block_shape(self, block_size: int) -> tuple[int, ...]:
        return (2, block_size, self.num_kv_heads, self.head_size)
