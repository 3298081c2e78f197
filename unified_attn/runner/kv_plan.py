"""KV-cache planning (no memory): layers grouped by `(manager_cls, config)` equality (a plain
dict: configs are frozen and hashable), large buckets split so every group has about the same
bytes per block, each group's block size (per-group sizes when the layers' caches cost
different bytes per token: `page_balance.py`), and the block size the backends agree on. The
worker sizes and allocates what `plan_kv_cache` returns.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import attrs
import torch

from unified_attn.backend import AttentionBackend, LayerConfig
from unified_attn.managers import KVCacheGroup, KVCacheManager, SchedulerKVCacheConfig
from unified_attn.runner.page_balance import (
    balance,
    block_size_multiple,
    candidate_block_sizes,
    needs_balancing,
    page_cost,
)
from unified_attn.tensor_specs import KVCacheTensorSpec
from unified_attn.utils import cdiv

DEFAULT_BLOCK_SIZE = 16


@attrs.frozen
class LayerPlan:
    """One attention layer as planning sees it: its config, backend and tensor spec."""

    layer: LayerConfig
    backend: AttentionBackend = attrs.field(eq=False)
    spec: KVCacheTensorSpec


@attrs.frozen
class GroupPlan:
    """One KV-cache group: layers whose backends declared the same `(manager_cls, config)`,
    sharing one block table per request."""

    manager_cls: type
    config: Any
    layers: tuple[LayerPlan, ...]
    block_size: int

    def page_bytes(self) -> int:
        """Bytes one block id takes in this group (all its layers)."""
        return sum(lp.spec.page_size_bytes(self.block_size) for lp in self.layers)


@attrs.frozen
class BoundLayer:
    """A layer's cache as `allocate` bound it: its group, spec, page offset and view."""

    group_id: int
    spec: KVCacheTensorSpec
    offset_bytes: int
    view: torch.Tensor | tuple[torch.Tensor, ...] = attrs.field(eq=False)


@attrs.frozen
class KVCachePlan:
    """Every group and the tokens per block: all the worker needs to size and allocate the
    cache, and all the scheduler needs (`scheduler_config`) besides the block count."""

    block_size: int  # the base block size: every group's, or the smallest of balanced groups
    groups: tuple[GroupPlan, ...]

    @property
    def bytes_per_block(self) -> int:
        return max((g.page_bytes() for g in self.groups), default=0)

    def wasted_bytes_per_block(self) -> list[int]:
        """Per group: bytes of a block that the group holds but never uses."""
        return [self.bytes_per_block - g.page_bytes() for g in self.groups]

    def scheduler_config(self, num_blocks: int) -> SchedulerKVCacheConfig:
        groups = [KVCacheGroup(g.manager_cls, g.config, g.block_size) for g in self.groups]
        return SchedulerKVCacheConfig(num_blocks, self.block_size, groups)

    def blocks_per_request(self, max_model_len: int, max_in_flight_tokens: int) -> list[int]:
        """Worst-case blocks one request of `max_model_len` tokens holds, per group."""
        if not self.groups:
            return []
        manager = KVCacheManager(
            self.scheduler_config(2), max_model_len, max_in_flight_tokens, enable_caching=False
        )
        return manager.max_blocks_per_request()


def plan_kv_cache(
    layers: Iterable[tuple[LayerConfig, AttentionBackend]], block_size: int | None = None
) -> KVCachePlan:
    """Group layers by `(manager_cls, config)`, split large buckets, choose the block size."""
    buckets: dict[tuple[type, Any], list[LayerPlan]] = {}
    backends: list[AttentionBackend] = []
    for layer, backend in layers:
        backend.check_layer(layer)
        cache_config = backend.get_cache_config()
        if cache_config is None:
            continue  # encoder and encoder-only self-attention keep no KV cache
        manager_cls, config, spec = cache_config
        buckets.setdefault((manager_cls, config), []).append(LayerPlan(layer, backend, spec))
        if all(backend is not b for b in backends):
            backends.append(backend)
    size = choose_block_size(backends, block_size)
    if needs_balancing([lp.spec for bucket in buckets.values() for lp in bucket]):
        return KVCachePlan(size, tuple(balanced_groups(buckets, size)))
    groups = [
        GroupPlan(manager_cls, config, tuple(part), size)
        for (manager_cls, config), bucket in buckets.items()
        for part in split_balanced(bucket, target_group_size(buckets))
    ]
    return KVCachePlan(size, tuple(groups))


def balanced_groups(buckets: dict[tuple[type, Any], list[LayerPlan]], base: int) -> list[GroupPlan]:
    """Groups whose pages are about equal: per bucket a block size (a power-of-two multiple of
    `base` that its specs and backends take) and a split (`page_balance.balance`)."""
    keys = list(buckets)
    sizes = [bucket_block_sizes(buckets[key], base) for key in keys]
    costs = [[page_cost(lp.spec) for lp in buckets[key]] for key in keys]
    choices = balance(costs, sizes)
    # A fixed-size state's page does not depend on its block size: it takes the largest, the
    # only boundaries where every group can hit, so it keeps no checkpoints that cannot be used.
    largest = max(c.block_size for c in choices)
    groups = []
    for key, choice, cost in zip(keys, choices, costs, strict=True):
        bucket = buckets[key]
        fixed = all(per_token == 0 for per_token, _ in cost)
        for part in sorted(choice.parts):
            layers = tuple(bucket[i] for i in part)
            groups.append(GroupPlan(*key, layers, largest if fixed else choice.block_size))
    return groups


def bucket_block_sizes(bucket: list[LayerPlan], base: int) -> list[int]:
    """The block sizes a bucket may use: `base * 2**k`, multiples of every spec's
    `block_size_multiple`, accepted by every backend."""
    multiple = math.lcm(*(block_size_multiple(lp.spec) for lp in bucket))
    accepted = [lp.backend.supported_kernel_block_sizes() for lp in bucket]
    limits = [set(a) for a in accepted if a is not None]
    sizes = candidate_block_sizes(base, multiple, set.intersection(*limits) if limits else None)
    if not sizes:
        raise ValueError(
            f"layers {[lp.layer.name for lp in bucket[:3]]} need a block size that is a multiple "
            f"of {multiple} and accepted by their backends, but no power-of-two multiple of "
            f"block_size={base} is; give a block_size that divides such a size (e.g. {multiple})"
        )
    return sizes


def target_group_size(buckets: dict[Any, list[LayerPlan]]) -> int:
    """Layers per group: the smallest bucket, so larger buckets split into about equal parts."""
    return min((len(b) for b in buckets.values()), default=1)


def split_balanced(bucket: list[LayerPlan], target: int) -> list[list[LayerPlan]]:
    """Split into `cdiv(len, target)` parts whose sizes differ by at most one."""
    num_parts = cdiv(len(bucket), target)
    base, extra = divmod(len(bucket), num_parts)
    parts, start = [], 0
    for i in range(num_parts):
        end = start + base + (1 if i < extra else 0)
        parts.append(bucket[start:end])
        start = end
    return parts


def choose_block_size(backends: list[AttentionBackend], requested: int | None) -> int:
    """The requested size (checked), else the size the backends prefer (when those that state
    one agree and every backend takes it), else 16 when every backend takes it, else the
    largest size all backends take. K/V pages interleave K and V, so a manager block cannot be
    split into smaller kernel blocks: every backend must accept the manager block size itself."""
    accepted = [b.supported_kernel_block_sizes() for b in backends]
    limits = [set(a) for a in accepted if a is not None]
    if requested is not None:
        if requested <= 0:
            raise ValueError(f"block_size must be positive, got {requested}")
        for backend, sizes in zip(backends, accepted, strict=True):
            if sizes is not None and requested not in sizes:
                raise ValueError(
                    f"block_size={requested} is not supported by backend {backend.name!r}; "
                    f"it accepts {sorted(sizes)}"
                )
        return requested
    preferred = {p for b in backends if (p := b.preferred_kernel_block_size()) is not None}
    if len(preferred) == 1:
        (size,) = preferred
        if all(a is None or size in a for a in accepted):
            return size
    common = set.intersection(*limits) if limits else None
    if common is None or DEFAULT_BLOCK_SIZE in common:
        return DEFAULT_BLOCK_SIZE
    if not common:
        raise ValueError(
            "no block size is accepted by every backend: "
            + ", ".join(
                f"{b.name}: {sorted(a or [])}" for b, a in zip(backends, accepted, strict=True)
            )
        )
    return max(common)
