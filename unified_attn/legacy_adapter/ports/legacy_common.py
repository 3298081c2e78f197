"""What the two ported backends share: their cache layout `[2, num_blocks, block_size, Hkv, D]`
(K, then V), learned sinks, the static getters (answered from class attributes) and the ALiBi
slopes of an impl as a float32 device tensor, made on its first forward."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from unified_attn.legacy_adapter.interfaces import (
    LegacyAttentionBackend,
    LegacyAttentionImpl,
    LegacyAttentionMetadata,
    LegacyAttentionMetadataBuilder,
    M,
)


class PortedImpl(LegacyAttentionImpl[M]):
    """An impl of a port: the constructor's ALiBi slopes (a list) as the tensor its math takes."""

    alibi: torch.Tensor | None = None  # float32 [num_heads] on the query's device, made once

    def _alibi(self, device: torch.device) -> torch.Tensor | None:
        if self.alibi_slopes is not None and self.alibi is None:
            self.alibi = torch.tensor(self.alibi_slopes, dtype=torch.float32, device=device)
        return self.alibi


class PortedBackend(LegacyAttentionBackend):
    """A port names its name and three classes; the getters the adapter calls return them."""

    legacy_name: ClassVar[str]
    impl_cls: ClassVar[type[LegacyAttentionImpl[Any]]]
    builder_cls: ClassVar[type[LegacyAttentionMetadataBuilder[Any]]]
    metadata_cls: ClassVar[type[LegacyAttentionMetadata]]

    @classmethod
    def get_name(cls) -> str:
        return cls.legacy_name

    @classmethod
    def get_impl_cls(cls) -> type[LegacyAttentionImpl[Any]]:
        return cls.impl_cls

    @classmethod
    def get_builder_cls(cls) -> type[LegacyAttentionMetadataBuilder[Any]]:
        return cls.builder_cls

    @classmethod
    def get_metadata_cls(cls) -> type[LegacyAttentionMetadata]:
        return cls.metadata_cls

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def supports_sink(cls) -> bool:
        return True
