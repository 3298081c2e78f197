"""The four legacy interfaces (vLLM before the one-class RFC): a static Backend naming the other
three, a MetadataBuilder per KV-cache group, the Metadata it builds every step, and an Impl per
layer. Kept verbatim in shape so old backends run unchanged through `LegacyBackendAdapter`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Generic, TypeVar

import attrs
import torch

from unified_attn.backend import AttentionType
from unified_attn.legacy_adapter.specs import AttentionSpec


class LegacyAttentionMetadata:
    """Whatever one backend's kernels need for one group and one step (subclasses add fields)."""


M = TypeVar("M", bound=LegacyAttentionMetadata)


@attrs.define
class LegacyCommonAttentionMetadata:
    """The per-group batch description a builder receives: like the unified metadata, but with
    this group's `block_table_tensor` and `slot_mapping` (vLLM copied it once per group)."""

    query_start_loc: torch.Tensor  # [B + 1] int32, device
    query_start_loc_cpu: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, device: computed + new tokens
    seq_lens_cpu: torch.Tensor  # [B] int32
    num_computed_tokens_cpu: torch.Tensor  # [B] int32
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor  # [B, max_blocks] int32, this group
    slot_mapping: torch.Tensor  # [T] int64, this group, -1 = padding
    positions: torch.Tensor | None = None  # [T] int64, device


@attrs.frozen
class LegacyAttentionLayer:
    """What an impl's `forward(layer, ...)` may read of its layer (vLLM's AttentionLayer)."""

    layer_name: str
    k_scale: float = 1.0
    v_scale: float = 1.0


class LegacyAttentionMetadataBuilder(ABC, Generic[M]):
    """One per KV-cache group: turns the step's batch into this backend's metadata."""

    def __init__(
        self, kv_cache_spec: AttentionSpec, layer_names: list[str], device: torch.device
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = layer_names
        self.device = device

    @abstractmethod
    def build(
        self, common_prefix_len: int, common_attn_metadata: LegacyCommonAttentionMetadata
    ) -> M:
        """This step's metadata for the group; `common_prefix_len` is always 0 (deprecated)."""

    def build_for_cudagraph_capture(self, common_attn_metadata: LegacyCommonAttentionMetadata) -> M:
        return self.build(0, common_attn_metadata)


class LegacyAttentionImpl(ABC, Generic[M]):
    """One per layer, holding the layer's static parameters."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: AttentionType,
        sinks: torch.Tensor | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.alibi_slopes = alibi_slopes
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = logits_soft_cap
        self.attn_type = attn_type
        self.sinks = sinks

    @abstractmethod
    def forward(
        self,
        layer: LegacyAttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: M,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """query `[T, Hq, D]`, key/value `[T, Hkv, D]`, kv_cache in `get_kv_cache_shape` layout;
        writes K/V into the cache, attention into `output [T, Hq, D]`, returns it."""


class LegacyAttentionBackend(ABC):
    """Static capability object, never instantiated."""

    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (
        torch.float16,
        torch.bfloat16,
        torch.float32,
    )

    @staticmethod
    @abstractmethod
    def get_name() -> str: ...

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[LegacyAttentionImpl[Any]]: ...

    @staticmethod
    @abstractmethod
    def get_builder_cls() -> type[LegacyAttentionMetadataBuilder[Any]]: ...

    @staticmethod
    @abstractmethod
    def get_metadata_cls() -> type[LegacyAttentionMetadata]: ...

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]: ...

    # ---- capabilities (vLLM's per-feature queries; the adapter turns them into reasons) -------

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any

    @classmethod
    def get_supported_kernel_block_sizes(cls) -> list[int] | None:
        return None  # any

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: AttentionType) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_device(cls, device_type: str) -> bool:
        return True

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return False
