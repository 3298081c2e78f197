"""The unified attention-backend contract: one class per backend.

A backend is one class with four methods. The engine calls them in this order:

1. **Construction** with the static parameters shared by every layer the instance serves
   (`num_kv_heads`, `head_size`, `dtype`, `sliding_window`, `attention_chunk_size`,
   `kv_cache_dtype`, `batch_invariant`, `num_sink_tokens`, backend-specific `**options`). The
   model builds one instance per attention kind and hands it to all layers of that kind.
2. **Planning** (before any memory exists): `get_cache_config()`, any number of times, and
   `check_layer(layer)` for every layer the instance serves.
3. **`bind_kv_caches(views, groups)`** once, after the worker has allocated the cache.
4. **Every step**: `prep_forward(common, block_tables)` exactly once, then `forward(layer, ...)`
   once per layer, in layer order, reading what `prep_forward` planned.

The rules a backend keeps:

- `get_cache_config` is pure: the same triple on every call, no side effects; layers are
  grouped by the `(manager_cls, config)` it returns.
- `prep_forward` does all host work of the step (index math, `.tolist()`, host-to-device
  copies, kernel plans) and stores it as **one typed plan object**, `self.plan`, whose type the
  backend declares (an attrs class, frozen where it can be, each field's device stated). It
  sets no other attribute. With `for_cudagraph_capture=True` the plan must read only tensors
  that later replays overwrite in place (the runner's persistent buffers, views of them, and
  scratch the backend sizes for the largest captured batch). With `plans_inside_cuda_graphs()`
  a `common.graph_step` step's `prep_forward` is captured with the forward instead (not called
  at replays, which re-plan from the persistent buffers): device work only, no host sync.
- `forward` may be captured in a CUDA graph (when `supports_cuda_graphs()` is True), so it must
  not allocate memory that outlives the call, synchronise with the host, call `.item()` /
  `.tolist()` / `.cpu()`, or read host tensors; it reads only its arguments, `self.plan` and
  the bound caches. It writes the new keys and values into the layer's cache at the group's slot
  mapping (slot -1 is padding: nothing is written) and the attention result into `output`.
- Bad input (shape, dtype, device) raises `ValueError` naming the layer, the expected and the
  found value (`check_forward_inputs`).

A minimal backend (the reference backend in `backends/reference.py` is a complete one):

```python
import attrs
import torch

from unified_attn import AttentionBackend, register_backend


@attrs.frozen
class CopyPlan:
    rows: dict[int, torch.Tensor]  # device: group id -> [W] rows of new tokens with a slot
    blocks: dict[int, torch.Tensor]  # device: group id -> [W] block id of each such row
    offsets: dict[int, torch.Tensor]  # device: group id -> [W] offset inside that block


@register_backend(priority={"cpu": 1})
class ValueCopyBackend(AttentionBackend[CopyPlan]):
    # Writes the cache, then returns each token's own value (a toy, not attention).
    name = "value-copy"

    def prep_forward(self, common, block_tables, for_cudagraph_capture=False):
        rows, blocks, offsets = {}, {}, {}
        for gid, slots in common.slot_mappings.items():
            size = common.block_sizes[gid]
            rows[gid] = torch.nonzero(slots >= 0).flatten()
            blocks[gid], offsets[gid] = slots[rows[gid]] // size, slots[rows[gid]] % size
        self.plan = CopyPlan(rows, blocks, offsets)

    def forward(self, layer, output, query, key, value, **kwargs):
        q, k, v = self.check_forward_inputs(layer, output, query, key, value)
        plan, gid = self.current_plan(), self.group_of_layer[layer.name]
        rows, blocks, offsets = plan.rows[gid], plan.blocks[gid], plan.offsets[gid]
        cache = self.kv_caches[layer.name]  # [num_blocks, 2, block_size, Hkv, D]
        cache[blocks, 0, offsets] = k[rows]
        cache[blocks, 1, offsets] = v[rows]
        output.view(q.shape)[:] = v.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        return output
```
"""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

import attrs
import torch

from unified_attn.managers import (
    ChunkedLocalAttentionManager,
    CrossAttentionManager,
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    StreamingSinkManager,
)
from unified_attn.tensor_specs import KVCacheTensorSpec, PagedKVSpec, as_dtype
from unified_attn.utils import optional_positive, optional_positive_int, positive_int

if TYPE_CHECKING:
    from unified_attn.selector import SelectorConfig

CacheConfig = tuple[type[SingleTypeKVCacheManager], Any, KVCacheTensorSpec]
PlanT = TypeVar("PlanT")  # a backend's per-step plan type


class AttentionType(str, enum.Enum):
    DECODER = "decoder"  # causal self-attention over the KV cache
    ENCODER = "encoder"  # bidirectional, over the request's own tokens (enc-dec encoder)
    ENCODER_ONLY = "encoder_only"  # bidirectional, no KV cache
    ENCODER_DECODER = "encoder_decoder"  # cross-attention to encoder outputs


@attrs.frozen
class LayerConfig:
    """Per-layer attention parameters. Tensors (sinks, alibi slopes) are forward kwargs."""

    name: str
    num_heads: int = attrs.field(validator=positive_int)
    num_kv_heads: int = attrs.field(validator=positive_int)
    head_size: int = attrs.field(validator=positive_int)
    scale: float
    sliding_window: int | None = attrs.field(default=None, validator=optional_positive_int)
    logits_soft_cap: float | None = attrs.field(default=None, validator=optional_positive)
    attn_type: AttentionType = AttentionType.DECODER
    chunk_size: int | None = attrs.field(default=None, validator=optional_positive_int)

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"layer {self.name}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )

    @property
    def causal(self) -> bool:
        return self.attn_type == AttentionType.DECODER


@attrs.frozen
class CommonAttentionMetadata:
    """Backend-agnostic batch description, built once per step by the runner and shared by every
    backend's `prep_forward`.

    Requests are rows `0..B-1`; their new tokens are packed: request i owns token rows
    `[query_start_loc[i], query_start_loc[i + 1])` at positions `num_computed_tokens[i] + j`.
    Fields named `*_cpu` and the plain ints are host values; the others live on the model's
    device. Under CUDA graphs the device tensors are views of persistent buffers, padded to the
    captured batch size (padding rows: sequence length 0, slot -1).
    """

    query_start_loc: torch.Tensor  # device [B + 1] int32
    query_start_loc_cpu: torch.Tensor  # host [B + 1] int32
    seq_lens: torch.Tensor  # device [B] int32: computed + new tokens
    seq_lens_cpu: torch.Tensor  # host [B] int32
    num_computed_tokens_cpu: torch.Tensor  # host [B] int32: tokens already in the cache
    positions: torch.Tensor  # device [T] int64
    num_reqs: int  # host: B
    num_actual_tokens: int  # host: T (tokens with data; device tensors may be longer)
    max_query_len: int  # host
    max_seq_len: int  # host
    slot_mappings: dict[int, torch.Tensor]  # device: group id -> [T] int64 slot, -1 = padding
    block_sizes: dict[int, int] = attrs.Factory(dict)  # host: group id -> tokens per block
    # Encoder-decoder models: each request's encoder length (0: none). A cross-attention
    # group's slot mapping is [E], the slots of the encoder tokens written this step (those
    # of requests whose encoder ran), in the order of the key/value rows its layers get.
    encoder_seq_lens_cpu: torch.Tensor | None = None  # host [B] int32
    encoder_seq_lens: torch.Tensor | None = None  # device [B] int32
    # A CUDA-graph decode step (capture and replays): every row, padding included, has
    # `max_query_len` tokens; the `*_cpu` fields are placeholders (plan from the device ones).
    graph_step: bool = False

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]


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
        manager: type[SingleTypeKVCacheManager]
        spec = PagedKVSpec(self.num_kv_heads, self.head_size, self.kv_cache_dtype)
        if self.attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY):
            return None
        if self.attn_type == AttentionType.ENCODER_DECODER:
            assert self.max_encoder_len is not None  # checked by the constructor
            return CrossAttentionManager, CrossAttentionManager.Config(self.max_encoder_len), spec
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
        return manager, config, spec

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
        if layer.attn_type != self.attn_type:
            raise ValueError(
                f"layer {layer.name}: attn_type={layer.attn_type.value} but its backend "
                f"instance was built with attn_type={self.attn_type.value}; give each attention "
                "type its own backend instance."
            )
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
            if tensor.dtype != self.dtype or tensor.device != query.device:
                raise ValueError(
                    f"layer {layer.name}: {what} is {tensor.dtype} on {tensor.device}, expected "
                    f"{self.dtype} on {query.device}"
                )
        q = query.view(num_tokens, layer.num_heads, layer.head_size)
        k = key.view(num_keys, layer.num_kv_heads, layer.head_size)
        v = value.view(num_keys, layer.num_kv_heads, layer.head_size)
        return q, k, v


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


# ---- layers with several cache users ----------------------------------------------------------
#
# A layer may keep several caches, each with its own allocation policy (for example a window of
# latents, compressed entries, a compressor's raw rows, an indexer's keys). Each cache is a
# *cache user*: its own `LayerConfig` and backend instance, its own `(manager, config, spec)`,
# planned and bound like any layer. Beyond the four methods, the users of one layer hand each
# other rows through the protocols below; the model programs against these and the backends'
# `cache_user_classes`, never against a backend class.


@attrs.frozen
class GatheredRows:
    """The cache rows each query token reads from one cache user: `cache [num_blocks,
    block_size, D]` (the user's bound view; key = value) at `blocks [T, S]`, `offsets [T, S]`
    (int64 or int32, one dtype), where `visible [T, S]` (bool)."""

    cache: torch.Tensor
    blocks: torch.Tensor
    offsets: torch.Tensor
    visible: torch.Tensor
    # [T] int64, optional: rows s >= lengths[t] are hidden (visible says so too), so a kernel
    # may stop there; set when visibility is a prefix
    lengths: torch.Tensor | None = None


@runtime_checkable
class RowSource(Protocol):
    """A cache user whose rows another user of the same layer attends over."""

    def gather_rows(
        self,
        layer: LayerConfig,
        query: torch.Tensor,
        key: torch.Tensor,
        selection: torch.Tensor | None = None,
    ) -> GatheredRows:
        """Write this step's `key` rows into the layer's cache (as `forward` would) and return
        the rows each token of `query [T, H, D]` reads, restricted to `selection [T, k]`
        (int64, -1 = none) when the user takes one. No host sync (graph-capturable)."""
        ...


@runtime_checkable
class RowSetAttention(Protocol):
    """The user that attends over the rows of several users in one softmax."""

    def attend_row_sets(
        self,
        layer: LayerConfig,
        output: torch.Tensor,
        query: torch.Tensor,
        row_sets: Sequence[GatheredRows],
        sinks: torch.Tensor,
    ) -> torch.Tensor:
        """One softmax of `query [T, H, D]` over every set's rows plus one learned sink logit
        per head (`sinks [H]`), into `output [T, H * D]`."""
        ...


@runtime_checkable
class WindowSource(Protocol):
    """A user that gathers fixed windows of raw rows (a compressor's state): which windows
    close in the current step, so the caller sizes `forward`'s output."""

    def closing_windows(self) -> tuple[int, torch.Tensor]:
        """(N, a host int: the windows closing in this step; their first positions `[N]`
        int64 on the device)."""
        ...


def as_capability(backend: AttentionBackend, protocol: type[Any], role: str) -> Any:
    """`backend` as `protocol` (annotate the result with it), or a `TypeError` naming the
    backend, the role and what it lacks: how a layer with several cache users checks its users
    once, when it is built."""
    if not isinstance(backend, protocol):
        raise TypeError(
            f"backend {type(backend).__name__} ({getattr(backend, 'name', '?')}) cannot serve "
            f"the {role} cache user: it does not implement {protocol.__name__}; pick a backend "
            "of the layer's kind (`unified-attn backends` lists them)"
        )
    return backend
