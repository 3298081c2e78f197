"""The unified attention-backend contract: one class per backend.

A backend declares its KV-cache needs (`get_cache_config`), receives its cache views once
(`bind_kv_caches`), does all host work of a step once (`prep_forward`) and runs device work per
layer (`forward`). Layers sharing an instance share its static parameters; per-layer parameters
come through `LayerConfig`.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch

from unified_attn.managers import (
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    StreamingSinkManager,
)
from unified_attn.tensor_specs import KVCacheTensorSpec, PagedKVSpec, as_dtype

if TYPE_CHECKING:
    from unified_attn.selector import SelectorConfig

CacheConfig = tuple[type[SingleTypeKVCacheManager], Any, KVCacheTensorSpec]


class AttentionType(str, enum.Enum):
    DECODER = "decoder"  # causal self-attention over the KV cache
    ENCODER = "encoder"  # bidirectional, over the request's own tokens (enc-dec encoder)
    ENCODER_ONLY = "encoder_only"  # bidirectional, no KV cache
    ENCODER_DECODER = "encoder_decoder"  # cross-attention to encoder outputs


def _optional_positive(_instance: object, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"LayerConfig.{attribute.name} must be positive or None, got {value}")


@attrs.frozen
class LayerConfig:
    """Per-layer attention parameters. Tensors (sinks, alibi slopes) are forward kwargs."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None = attrs.field(default=None, validator=_optional_positive)
    logits_soft_cap: float | None = attrs.field(default=None, validator=_optional_positive)
    attn_type: AttentionType = AttentionType.DECODER
    chunk_size: int | None = attrs.field(default=None, validator=_optional_positive)

    def __attrs_post_init__(self) -> None:
        if self.num_heads <= 0 or self.num_kv_heads <= 0 or self.head_size <= 0:
            raise ValueError(
                f"layer {self.name}: num_heads, num_kv_heads and head_size must be positive, got "
                f"{self.num_heads}, {self.num_kv_heads}, {self.head_size}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"layer {self.name}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )

    @property
    def causal(self) -> bool:
        return self.attn_type == AttentionType.DECODER


@attrs.define
class CommonAttentionMetadata:
    """Backend-agnostic batch description, built once per step by the runner.

    Requests are rows; their new tokens are packed: request i owns tokens
    `[query_start_loc[i], query_start_loc[i + 1])`. `seq_lens` = computed + new tokens.
    """

    query_start_loc: torch.Tensor  # [B + 1] int32, device
    query_start_loc_cpu: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, device
    seq_lens_cpu: torch.Tensor  # [B] int32
    num_computed_tokens_cpu: torch.Tensor  # [B] int32
    positions: torch.Tensor  # [T] int64, device
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    slot_mappings: dict[int, torch.Tensor]  # group id -> [T] int64, -1 = padding
    block_sizes: dict[int, int] = attrs.Factory(dict)  # group id -> tokens per block

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]


class AttentionBackend(ABC):
    """One instance serves every layer with the same static parameters."""

    name: ClassVar[str]
    # The layer kinds this backend computes (`SelectorConfig.layer_kind`).
    layer_kinds: ClassVar[tuple[str, ...]] = ("attention",)

    def __init__(
        self,
        *,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype | str,
        sliding_window: int | None = None,
        attention_chunk_size: int | None = None,
        kv_cache_dtype: str = "auto",
        batch_invariant: bool = False,
        num_sink_tokens: int = 0,
        **options: Any,
    ) -> None:
        if sliding_window is not None and attention_chunk_size is not None:
            raise ValueError(
                f"{type(self).__name__}: sliding_window={sliding_window} and "
                f"attention_chunk_size={attention_chunk_size} are exclusive; use one backend "
                "instance per attention kind."
            )
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.dtype = as_dtype(dtype)
        self.sliding_window = sliding_window
        self.attention_chunk_size = attention_chunk_size
        self.kv_cache_dtype = self.dtype if kv_cache_dtype == "auto" else as_dtype(kv_cache_dtype)
        if num_sink_tokens < 0 or (num_sink_tokens and sliding_window is None):
            raise ValueError(
                f"{type(self).__name__}: num_sink_tokens={num_sink_tokens} needs a sliding "
                "window and must be >= 0 (StreamingLLM keeps the first tokens plus a window)"
            )
        # Backends that support it compute every request independently of the batch.
        self.batch_invariant = batch_invariant
        # StreamingLLM: queries also see the first `num_sink_tokens` tokens, kept forever.
        self.num_sink_tokens = num_sink_tokens
        self.options = options
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.group_of_layer: dict[str, int] = {}
        if options:
            raise ValueError(
                f"{type(self).__name__} got unknown options {sorted(options)}; "
                "remove them or use a backend that supports them."
            )

    # ---- capabilities --------------------------------------------------------------------------

    @classmethod
    def validate_configuration(cls, cfg: SelectorConfig) -> list[str]:
        """Reasons this backend cannot serve `cfg`; [] means it can."""
        return []

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        """True if a request's output never depends on the rest of the batch."""
        return False

    @classmethod
    def supports_cuda_graphs(cls) -> bool:
        """True if `forward` only reads tensors that `prep_forward` keeps persistent, so a
        decode step can be captured once and replayed."""
        return False

    @classmethod
    def supported_kernel_block_sizes(cls) -> tuple[int, ...] | None:
        """Kernel block sizes the backend accepts; None = any."""
        return None

    # ---- the contract --------------------------------------------------------------------------

    def get_cache_config(self) -> CacheConfig:
        """`(manager_cls, manager_cls.Config(...), tensor spec)`; pure: same triple every call."""
        manager: type[SingleTypeKVCacheManager]
        if self.sliding_window is not None and self.num_sink_tokens:
            manager = StreamingSinkManager
            config: Any = StreamingSinkManager.Config(self.num_sink_tokens, self.sliding_window)
        elif self.sliding_window is not None:
            manager = SlidingWindowManager
            config = SlidingWindowManager.Config(sliding_window=self.sliding_window)
        elif self.attention_chunk_size is not None:
            manager = ChunkedLocalAttentionManager
            config = ChunkedLocalAttentionManager.Config(
                attention_chunk_size=self.attention_chunk_size
            )
        else:
            manager, config = FullAttentionManager, FullAttentionManager.Config()
        spec = PagedKVSpec(self.num_kv_heads, self.head_size, self.kv_cache_dtype)
        return manager, config, spec

    def bind_kv_caches(
        self, kv_caches: dict[str, torch.Tensor], block_table_map: dict[str, int]
    ) -> None:
        """Keep the cache view and the KV-cache group of every layer this instance serves."""
        self.kv_caches = dict(kv_caches)
        self.group_of_layer = dict(block_table_map)

    @abstractmethod
    def prep_forward(
        self,
        common: CommonAttentionMetadata,
        block_tables: dict[int, torch.Tensor],
        for_cudagraph_capture: bool = False,
    ) -> None:
        """All host work of a step: index tensors, plans, copies into persistent buffers."""

    @abstractmethod
    def forward(
        self,
        layer: LayerConfig,
        output: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Write K/V at the group's slot mapping, attend, write `output [T, Hq * D]`."""

    # ---- helpers for implementations -----------------------------------------------------------

    def check_layer(self, layer: LayerConfig) -> None:
        """Planning check: the layer's window/chunk must agree with this instance's manager."""
        if layer.sliding_window != self.sliding_window:
            raise ValueError(
                f"layer {layer.name}: sliding_window={layer.sliding_window} but its backend "
                f"instance was built with sliding_window={self.sliding_window}; give layers with "
                "different windows different backend instances."
            )
        if layer.chunk_size != self.attention_chunk_size:
            raise ValueError(
                f"layer {layer.name}: chunk_size={layer.chunk_size} but its backend instance was "
                f"built with attention_chunk_size={self.attention_chunk_size}."
            )
        if layer.num_kv_heads != self.num_kv_heads or layer.head_size != self.head_size:
            raise ValueError(
                f"layer {layer.name}: (num_kv_heads, head_size)=({layer.num_kv_heads}, "
                f"{layer.head_size}) but the backend has ({self.num_kv_heads}, {self.head_size})"
            )

    def check_forward_inputs(
        self,
        layer: LayerConfig,
        output: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Validate shapes/dtypes/devices; return q `[T, Hq, D]`, k and v `[T, Hkv, D]`."""
        num_tokens = query.shape[0]
        expected = {
            "query": (query, (num_tokens, layer.num_heads * layer.head_size)),
            "key": (key, (num_tokens, layer.num_kv_heads * layer.head_size)),
            "value": (value, (num_tokens, layer.num_kv_heads * layer.head_size)),
            "output": (output, (num_tokens, layer.num_heads * layer.head_size)),
        }
        for what, (tensor, shape) in expected.items():
            if tensor.reshape(tensor.shape[0], -1).shape != shape:
                raise ValueError(
                    f"layer {layer.name}: {what} has shape {tuple(tensor.shape)}, expected "
                    f"{shape} (or its [T, heads, head_size] form)"
                )
            if tensor.dtype != self.dtype or tensor.device != query.device:
                raise ValueError(
                    f"layer {layer.name}: {what} is {tensor.dtype} on {tensor.device}, expected "
                    f"{self.dtype} on {query.device}"
                )
        q = query.view(num_tokens, layer.num_heads, layer.head_size)
        k = key.view(num_tokens, layer.num_kv_heads, layer.head_size)
        v = value.view(num_tokens, layer.num_kv_heads, layer.head_size)
        return q, k, v
