"""Layers with several cache users: what the users of one layer hand each other, as typed
protocols (`RowSource`, `RowSetAttention`, `WindowSource`), the rows they exchange
(`GatheredRows`) and `as_capability`, the check a layer runs once when it is built."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import torch

from unified_attn.backend.attention_backend import AttentionBackend
from unified_attn.backend.layer_types import LayerConfig

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
