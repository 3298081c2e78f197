"""`AttentionBackend`, the one class a backend is (the package docstring states the call order
and rules), and `require_cache_config`."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import torch

from unified_attn.backend.layer_types import (
    AttentionType,
    CacheConfig,
    CommonAttentionMetadata,
    LayerConfig,
)
from unified_attn.managers import default_paged_manager
from unified_attn.tensor_specs import PagedKVSpec, as_dtype

if TYPE_CHECKING:
    from unified_attn.selector import SelectorConfig

PlanT = TypeVar("PlanT")  # a backend's per-step plan type


class AttentionBackend(ABC, Generic[PlanT]):
    """One instance serves every layer with the same static parameters.

    Subclass it as `AttentionBackend[MyPlan]`, set `name`, implement `prep_forward` (build a
    `MyPlan`, store it in `self.plan`) and `forward`; override `get_cache_config` for a cache
    other than paged K/V under the window / chunk manager, and the capability class methods
    for what the backend supports. The module docstring states the call order and rules.
    """

    name: ClassVar[str]
    # The layer kinds this backend computes (`SelectorConfig.layer_kind`).
    layer_kinds: ClassVar[tuple[str, ...]] = ("attention",)
    # What `prep_forward` planned for the current step; `forward` reads it.
    plan: PlanT | None
    # Bound by `bind_kv_caches`: layer name -> cache view, layer name -> KV-cache group id.
    kv_caches: dict[str, Any]
    group_of_layer: dict[str, int]

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
        attn_type: AttentionType | str = AttentionType.DECODER,
        max_encoder_len: int | None = None,
        **options: Any,
    ) -> None:
        self.attn_type = AttentionType(attn_type)
        if (self.attn_type == AttentionType.ENCODER_DECODER) != (max_encoder_len is not None):
            raise ValueError(
                f"{type(self).__name__}: attn_type={self.attn_type.value} with "
                f"max_encoder_len={max_encoder_len}: cross-attention (encoder_decoder) backends "
                "need max_encoder_len (the longest encoder input, which sizes the cross cache) "
                "and other types take none"
            )
        if max_encoder_len is not None and max_encoder_len <= 0:
            raise ValueError(
                f"{type(self).__name__}: max_encoder_len must be positive, got {max_encoder_len}"
            )
        self.max_encoder_len = max_encoder_len
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
        self.kv_caches = {}
        self.group_of_layer = {}
        self.plan = None
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
    def plans_inside_cuda_graphs(cls) -> bool:
        """True if a graph step's `prep_forward` is device work alone (the rule above): the
        runner captures it with the forward and does not call it at replays."""
        return False

    @classmethod
    def supported_kernel_block_sizes(cls) -> tuple[int, ...] | None:
        """Kernel block sizes the backend accepts; None = any."""
        return None

    @classmethod
    def preferred_kernel_block_size(cls) -> int | None:
        """The block size the backend's fastest kernel wants when the user names none; None =
        no preference. The worker takes it when the backends that state one agree and every
        backend accepts it (`runner.worker.choose_block_size`)."""
        return None

    @classmethod
    def cache_user_classes(cls) -> Mapping[str, type[AttentionBackend]]:
        """For a layer with several caches (see "Layers with several cache users" below): the
        class serving each cache user other than the one of this class, by role. {} for
        backends whose layers keep one cache. The model builds one instance per user from
        these (a kernel backend overrides the mapping with its own classes); the selector
        refuses a backend without a class for every role a layer kind needs
        (`SelectorConfig.cache_users`)."""
        return {}

    # ---- the contract --------------------------------------------------------------------------

    def get_cache_config(self) -> CacheConfig | None:
        """`(manager_cls, manager_cls.Config(...), tensor spec)` for every layer this instance
        serves, or None when its layers keep no KV cache. Pure: the same answer on every call,
        nothing else changes. The worker groups layers by `(manager_cls, config)` equality and
        sizes pages with the spec.

        The default: paged K/V (`PagedKVSpec`) under the manager of this instance's kind:
        full, sliding window, chunked local, StreamingLLM sinks + window, cross-attention
        (`CrossAttentionManager`: the encoder's keys and values of each request), and None
        for encoder and encoder-only self-attention."""
        if self.attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY):
            return None
        manager, config = default_paged_manager(  # managers/default_policy.py
            sliding_window=self.sliding_window,
            num_sink_tokens=self.num_sink_tokens,
            attention_chunk_size=self.attention_chunk_size,
            max_encoder_len=self.max_encoder_len,  # set for cross-attention only
        )
        return manager, config, PagedKVSpec(self.num_kv_heads, self.head_size, self.kv_cache_dtype)

    def bind_kv_caches(self, kv_caches: dict[str, Any], block_table_map: dict[str, int]) -> None:
        """Called once, after allocation. `kv_caches[layer_name]` is the view the layer's tensor
        spec made (for `PagedKVSpec`: `[num_blocks, 2, block_size, num_kv_heads, head_size]`,
        index 0 = K, 1 = V; views of different groups may alias the same bytes), and
        `block_table_map[layer_name]` its KV-cache group id. Keep what the layers need."""
        self.kv_caches = dict(kv_caches)
        self.group_of_layer = dict(block_table_map)

    @abstractmethod
    def prep_forward(
        self,
        common: CommonAttentionMetadata,
        block_tables: dict[int, torch.Tensor],
        for_cudagraph_capture: bool = False,
    ) -> None:
        """All host work of a step, once, before the model forward: build this backend's plan
        and store it in `self.plan` (and nothing else).

        `common`: the batch (see `CommonAttentionMetadata`). `block_tables[gid]`: device
        `[num_reqs, max_blocks]` int32 physical block ids of each request, for the KV-cache
        groups this instance's layers belong to; position j holds tokens
        `[j * block_size, (j + 1) * block_size)`, and positions a manager freed (outside a
        window) hold stale ids or the null block 0 and must not be read. With
        `for_cudagraph_capture=True` the tensors are the persistent buffers a graph is captured
        over: plan only with views of them and scratch sized for any later replay."""

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
        """One layer of the step planned by `prep_forward`: write `key`/`value` into the layer's
        cache at its group's slot mapping (slot -1: skip), attend, fill `output`, return it.

        `query [T, num_heads * head_size]`, `key`/`value [T, num_kv_heads * head_size]` (or
        their `[T, heads, head_size]` views), `output [T, num_heads * head_size]`, all of the
        backend's dtype on one device; T may exceed `common.num_actual_tokens` (CUDA-graph
        padding). `kwargs`: per-layer tensors such as `sinks [num_heads]` float32 (learned sink
        logits) and `alibi_slopes [num_heads]`. No allocation that outlives the call, no host
        sync, no host tensors: the call may be captured in a CUDA graph."""

    def current_plan(self) -> PlanT:
        """The plan `prep_forward` stored for this step (for `forward`)."""
        if self.plan is None:
            raise RuntimeError(
                f"{self.name}: forward ran before prep_forward; the runner calls "
                "prep_forward(common, block_tables) once per step before the model forward"
            )
        return self.plan

    # ---- helpers for implementations -----------------------------------------------------------

    def check_layer(self, layer: LayerConfig) -> None:
        """Planning check: the layer's type, window and chunk must agree with this instance's
        manager."""
        # (the layer's field, its value, this instance's parameter, its value, the advice)
        must_match = (
            ("attn_type", layer.attn_type.value, "attn_type", self.attn_type.value,
             "; give each attention type its own backend instance."),
            ("sliding_window", layer.sliding_window, "sliding_window", self.sliding_window,
             "; give layers with different windows different backend instances."),
            ("chunk_size", layer.chunk_size, "attention_chunk_size", self.attention_chunk_size,
             "."),
        )  # fmt: skip
        for field, got, param, want, advice in must_match:
            if got != want:
                raise ValueError(
                    f"layer {layer.name}: {field}={got} but its backend instance was built "
                    f"with {param}={want}{advice}"
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
        """Validate shapes/dtypes/devices; return q `[T, Hq, D]`, k and v `[T, Hkv, D]` (for
        cross-attention `[E, Hkv, D]`: the encoder tokens written this step)."""
        num_tokens = query.shape[0]
        num_keys = key.shape[0] if layer.attn_type == AttentionType.ENCODER_DECODER else num_tokens
        expected = {
            "query": (query, (num_tokens, layer.num_heads * layer.head_size)),
            "key": (key, (num_keys, layer.num_kv_heads * layer.head_size)),
            "value": (value, (num_keys, layer.num_kv_heads * layer.head_size)),
            "output": (output, (num_tokens, layer.num_heads * layer.head_size)),
        }
        for what, (tensor, shape) in expected.items():
            if (tensor.shape[0], math.prod(tensor.shape[1:])) != shape:
                raise ValueError(
                    f"layer {layer.name}: {what} has shape {tuple(tensor.shape)}, expected "
                    f"{shape} (or its [T, heads, head_size] form)"
                )
            check_dtype_device(layer, what, tensor, self.dtype, query.device)
        q = query.view(num_tokens, layer.num_heads, layer.head_size)
        k = key.view(num_keys, layer.num_kv_heads, layer.head_size)
        v = value.view(num_keys, layer.num_kv_heads, layer.head_size)
        return q, k, v


def check_dtype_device(
    layer: LayerConfig, what: str, tensor: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> None:
    """The dtype and device half of a forward input check: a `ValueError` naming the layer, the
    input, and the expected and found values (backends check shapes their own way)."""
    if tensor.dtype != dtype or tensor.device != device:
        raise ValueError(
            f"layer {layer.name}: {what} is {tensor.dtype} on {tensor.device}, expected {dtype} "
            f"on {device}"
        )


def soft_cap_reasons(cfg: SelectorConfig) -> list[str]:
    """`validate_configuration`'s reason of a backend without a logits soft cap."""
    if cfg.logits_soft_cap is None:
        return []
    return [f"logits soft cap {cfg.logits_soft_cap:g} is not supported"]


def refuse_soft_cap(layer: LayerConfig, backends: str) -> None:
    """`check_layer` of backends without a logits soft cap (`backends` names them in the
    message): a `ValueError` for a layer that has one."""
    if layer.logits_soft_cap is not None:
        raise ValueError(
            f"layer {layer.name}: logits_soft_cap={layer.logits_soft_cap} is not supported "
            f"by {backends}; give the layer logits_soft_cap=None"
        )


def require_cache_config(backend: AttentionBackend) -> CacheConfig:
    """`backend.get_cache_config()` for callers that need a cache (harness drivers): a
    `ValueError` when the backend's layers keep none."""
    config = backend.get_cache_config()
    if config is None:
        raise ValueError(
            f"backend {backend.name!r} (attn_type={backend.attn_type.value}) keeps no KV cache; "
            "this check needs a backend whose layers have one"
        )
    return config
