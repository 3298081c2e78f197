"""`LegacyBackendAdapter`: a four-class backend behind the one-class contract.

- `get_cache_config`: the legacy spec the old attention layer would have built, split by
  `split_spec` into `(manager_cls, config, tensor spec)`.
- `bind_kv_caches`: one legacy cache view per layer (the layout `get_kv_cache_shape` declares,
  as a view of the unified page) and one builder per KV-cache group.
- `prep_forward`: `builder.build(0, per-group common metadata)` for every group served.
- `forward`: the layer's impl (created on the layer's first forward, then reused).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, cast

import attrs
import torch

from unified_attn.backend import AttentionBackend, CacheConfig, CommonAttentionMetadata, LayerConfig
from unified_attn.legacy_adapter.interfaces import (
    LegacyAttentionBackend,
    LegacyAttentionImpl,
    LegacyAttentionLayer,
    LegacyAttentionMetadataBuilder,
    LegacyCommonAttentionMetadata,
)
from unified_attn.legacy_adapter.layout import to_legacy_layout
from unified_attn.legacy_adapter.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
)
from unified_attn.legacy_adapter.split import split_spec

if TYPE_CHECKING:
    from unified_attn.selector import SelectorConfig

# The block size written into the spec `get_cache_config` splits. It is dropped by the split
# (the worker chooses the block size); builders get a spec with the bound block size.
NOMINAL_BLOCK_SIZE = 16


@attrs.frozen
class BoundImpl:
    """A layer's impl and what it was built from (re-built only if those change)."""

    layer: LayerConfig
    sinks: torch.Tensor | None
    alibi_slopes: torch.Tensor | None
    impl: LegacyAttentionImpl[Any]
    legacy_layer: LegacyAttentionLayer


@attrs.frozen
class LegacyPlan:
    # group id -> the legacy metadata object its builder made for this step (the legacy
    # backend's own per-step type; its fields are that backend's business)
    metadata: dict[int, Any]


class LegacyBackendAdapter(AttentionBackend[LegacyPlan]):
    """`LegacyBackendAdapter(LegacyCls, num_kv_heads=..., ...)`, or `wrap(LegacyCls)` for a
    subclass the engine can construct with keywords only."""

    name = "legacy-adapter"
    legacy_backend: ClassVar[type[LegacyAttentionBackend] | None] = None

    @classmethod
    def wrap(cls, legacy_backend_cls: type[LegacyAttentionBackend]) -> type[LegacyBackendAdapter]:
        """A subclass bound to `legacy_backend_cls`, named `legacy-<get_name()>`."""
        namespace = {
            "legacy_backend": legacy_backend_cls,
            "__module__": cls.__module__,
            "name": "legacy-" + legacy_backend_cls.get_name(),
            "__doc__": f"{legacy_backend_cls.__name__} through LegacyBackendAdapter.",
        }
        return cast(
            type[LegacyBackendAdapter],
            type(f"{legacy_backend_cls.__name__}Adapter", (cls,), namespace),
        )

    # ---- capabilities: the legacy per-feature queries, as reasons -----------------------------

    @classmethod
    def validate_configuration(cls, cfg: SelectorConfig) -> list[str]:
        legacy = cls.legacy_backend
        if legacy is None:
            return ["no legacy backend bound: use LegacyBackendAdapter.wrap(LegacyBackendCls)"]
        return capability_reasons(legacy, cfg)

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return cls.legacy_backend is not None and cls.legacy_backend.supports_batch_invariance()

    @classmethod
    def supported_kernel_block_sizes(cls) -> tuple[int, ...] | None:
        if cls.legacy_backend is None:
            return None
        sizes = cls.legacy_backend.get_supported_kernel_block_sizes()
        return None if sizes is None else tuple(sizes)

    # ---- the contract --------------------------------------------------------------------------

    def __init__(
        self, legacy_backend_cls: type[LegacyAttentionBackend] | None = None, /, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        legacy = legacy_backend_cls or type(self).legacy_backend
        if legacy is None:
            raise ValueError(
                "LegacyBackendAdapter needs a legacy backend class: pass it as the first "
                "argument or use LegacyBackendAdapter.wrap(LegacyBackendCls)"
            )
        if getattr(self, "num_sink_tokens", 0):
            raise ValueError(
                f"{self.name}: legacy KV-cache specs have no streaming-sink policy "
                f"(num_sink_tokens={self.num_sink_tokens}); use a native backend for this layer"
            )
        self.legacy = legacy
        self.builders: dict[int, LegacyAttentionMetadataBuilder[Any]] = {}
        self.legacy_caches: dict[str, torch.Tensor] = {}
        self.impls: dict[str, BoundImpl] = {}

    def legacy_spec(self, block_size: int = NOMINAL_BLOCK_SIZE) -> AttentionSpec:
        """The spec the old attention layer built for this instance's layers."""
        layout: dict[str, Any] = {
            "block_size": block_size,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "dtype": self.kv_cache_dtype,
        }
        if self.sliding_window is not None:
            return SlidingWindowSpec(sliding_window=self.sliding_window, **layout)
        if self.attention_chunk_size is not None:
            return ChunkedLocalAttentionSpec(
                attention_chunk_size=self.attention_chunk_size, **layout
            )
        return FullAttentionSpec(**layout)

    def get_cache_config(self) -> CacheConfig:
        return split_spec(self.legacy_spec())

    def bind_kv_caches(
        self, kv_caches: dict[str, torch.Tensor], block_table_map: dict[str, int]
    ) -> None:
        super().bind_kv_caches(kv_caches, block_table_map)
        self.legacy_caches = {
            name: to_legacy_layout(self.legacy, view) for name, view in kv_caches.items()
        }
        layers_of_group: dict[int, list[str]] = {}
        for name, gid in block_table_map.items():
            layers_of_group.setdefault(gid, []).append(name)
        builder_cls = self.legacy.get_builder_cls()
        self.builders = {}
        for gid, names in layers_of_group.items():
            view = kv_caches[names[0]]  # [num_blocks, 2, block_size, Hkv, D]
            self.builders[gid] = builder_cls(self.legacy_spec(view.shape[2]), names, view.device)
        self.impls = {}

    def prep_forward(
        self,
        common: CommonAttentionMetadata,
        block_tables: dict[int, torch.Tensor],
        for_cudagraph_capture: bool = False,
    ) -> None:
        metadata = {}
        for gid, table in block_tables.items():
            builder = self.builders.get(gid)
            if builder is None:
                raise ValueError(
                    f"{self.name}: prep_forward got KV-cache group {gid} but the bound groups "
                    f"are {sorted(self.builders)}; call bind_kv_caches first"
                )
            group_common = per_group_common(common, gid, table)
            if for_cudagraph_capture:
                metadata[gid] = builder.build_for_cudagraph_capture(group_common)
            else:
                metadata[gid] = builder.build(0, group_common)
        self.plan = LegacyPlan(metadata)

    def forward(
        self,
        layer: LayerConfig,
        output: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor:
        q, k, v = self.check_forward_inputs(layer, output, query, key, value)
        bound = self.bound_impl(layer, kwargs.get("sinks"), kwargs.get("alibi_slopes"))
        metadata = self.current_plan().metadata[self.group_of_layer[layer.name]]
        bound.impl.forward(
            bound.legacy_layer,
            q,
            k,
            v,
            self.legacy_caches[layer.name],
            metadata,
            output.view(q.shape),
        )
        return output

    # ---- impls ---------------------------------------------------------------------------------

    def bound_impl(
        self, layer: LayerConfig, sinks: torch.Tensor | None, alibi: torch.Tensor | None
    ) -> BoundImpl:
        """The layer's impl; identity checks keep the steady state free of work."""
        bound = self.impls.get(layer.name)
        if (
            bound is not None
            and bound.sinks is sinks
            and bound.alibi_slopes is alibi
            and (bound.layer is layer or bound.layer == layer)
        ):
            return bound
        bound = BoundImpl(
            layer,
            sinks,
            alibi,
            self.make_impl(layer, sinks, alibi),
            LegacyAttentionLayer(layer.name),
        )
        self.impls[layer.name] = bound
        return bound

    def make_impl(
        self, layer: LayerConfig, sinks: torch.Tensor | None, alibi: torch.Tensor | None
    ) -> LegacyAttentionImpl[Any]:
        kv_cache_dtype = "auto" if self.kv_cache_dtype == self.dtype else str(self.kv_cache_dtype)
        return self.legacy.get_impl_cls()(
            num_heads=layer.num_heads,
            head_size=layer.head_size,
            scale=layer.scale,
            num_kv_heads=layer.num_kv_heads,
            alibi_slopes=None if alibi is None else alibi.tolist(),
            sliding_window=layer.sliding_window,
            kv_cache_dtype=kv_cache_dtype,
            logits_soft_cap=layer.logits_soft_cap,
            attn_type=layer.attn_type,
            sinks=sinks,
        )


# The legacy metadata's fields taken from the unified metadata's field of the same name: all but
# the two per-group ones.
SHARED_COMMON_FIELDS = tuple(
    field.name
    for field in attrs.fields(LegacyCommonAttentionMetadata)
    if field.name not in ("block_table_tensor", "slot_mapping")
)


def per_group_common(
    common: CommonAttentionMetadata, gid: int, block_table: torch.Tensor
) -> LegacyCommonAttentionMetadata:
    """The legacy per-group metadata: shared tensors plus this group's table and slots."""
    shared = {name: getattr(common, name) for name in SHARED_COMMON_FIELDS}
    return LegacyCommonAttentionMetadata(
        **shared, block_table_tensor=block_table, slot_mapping=common.slot_mappings[gid]
    )


def capability_reasons(legacy: type[LegacyAttentionBackend], cfg: SelectorConfig) -> list[str]:
    """vLLM's per-feature capability queries turned into the unified list of reasons."""
    reasons = []
    device = torch.device(cfg.device).type
    if not legacy.supports_device(device):
        reasons.append(f"legacy backend {legacy.get_name()} does not run on {device}")
    if cfg.dtype not in legacy.supported_dtypes:
        reasons.append(f"dtype {cfg.dtype} is not one of {legacy.supported_dtypes}")
    if cfg.kv_cache_dtype not in ("auto", cfg.dtype):
        reasons.append(f"KV-cache dtype {cfg.kv_cache_dtype} must equal the model dtype")
    head_sizes = legacy.get_supported_head_sizes()
    if head_sizes and cfg.head_size not in head_sizes:
        reasons.append(f"head size {cfg.head_size} is not one of {head_sizes}")
    block_sizes = legacy.get_supported_kernel_block_sizes()
    if cfg.block_size is not None and block_sizes and cfg.block_size not in block_sizes:
        reasons.append(f"block size {cfg.block_size} is not one of {block_sizes}")
    if cfg.has_sinks and not legacy.supports_sink():
        reasons.append("attention sinks are not supported")
    if cfg.num_sink_tokens:
        reasons.append("streaming sink tokens have no legacy KV-cache spec")
    if not legacy.supports_attn_type(cfg.attn_type):
        reasons.append(f"attention type {cfg.attn_type.value} is not supported")
    return reasons


def adapt_legacy_class(cls: type) -> type[AttentionBackend] | None:
    """The registry's class adapter: a four-class backend class wrapped (None for others)."""
    if issubclass(cls, LegacyAttentionBackend):
        return LegacyBackendAdapter.wrap(cls)
    return None
