"""What a model runner derives from the KV-cache plan and the model once: the backend instances
and the groups each serves, cross-attention groups, encoder limits, cache-less backends."""

from __future__ import annotations

from typing import Any

from unified_attn.backend import AttentionBackend, AttentionType
from unified_attn.runner.worker import KVCachePlan


def cross_group_ids(plan: KVCachePlan) -> list[int]:
    """KV-cache groups of cross-attention layers (they hold encoder keys and values)."""
    return [
        gid
        for gid, group in enumerate(plan.groups)
        if any(lp.layer.attn_type == AttentionType.ENCODER_DECODER for lp in group.layers)
    ]


def encoder_limits(plan: KVCachePlan) -> list[int]:
    """The longest encoder input of each cross-attention backend of the plan."""
    return [
        lp.backend.max_encoder_len
        for group in plan.groups
        for lp in group.layers
        if lp.backend.max_encoder_len is not None
    ]


def no_cache_backends(model: Any) -> list[AttentionBackend]:
    """Distinct backend instances of the model's encoder and encoder-only layers (none without
    a model: runners that only lay batches out)."""
    out: list[AttentionBackend] = []
    for layer, backend in model.attention_layers() if model is not None else ():
        no_cache = layer.attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY)
        if no_cache and all(backend is not b for b in out):
            out.append(backend)
    return out


def backend_group_ids(plan: KVCachePlan) -> list[tuple[AttentionBackend, list[int]]]:
    """Distinct backend instances (first-seen order) and the KV-cache groups they serve."""
    out: list[tuple[AttentionBackend, list[int]]] = []
    for gid, group in enumerate(plan.groups):
        for lp in group.layers:
            for backend, gids in out:
                if backend is lp.backend:
                    if gid not in gids:
                        gids.append(gid)
                    break
            else:
                out.append((lp.backend, [gid]))
    return out
