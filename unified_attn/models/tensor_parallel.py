"""Tensor-parallel shards of a decoder model (Megatron-style).

Rank `r` of `N` keeps query heads `[r * Hq/N, (r + 1) * Hq/N)` with the KV heads they read
(split when `Hkv >= N`, else one replicated head per rank), and the same slice of every MLP's
intermediate features. Column-parallel projections (q/k/v, gate/up) keep their output rows;
row-parallel ones (`o_proj`, `down_proj`) keep their input columns and sum the ranks' partial
outputs with one all-reduce each (`RowParallelLinear`), their bias added once after it.
Embeddings, norms and the LM head are replicated. Each rank's backends are built for its local
head counts: the backend contract is unchanged.

A shard is cut from a full model (`shard_decoder`), so its weights are exactly the full
model's: greedy tokens match the single-device model up to the float rounding of the sums.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import attrs
import torch
from torch import nn

from unified_attn.models.config import ModelConfig
from unified_attn.models.decoder import DecoderModel

AllReduce = Callable[[torch.Tensor], None]  # sums a tensor over the ranks, in place


@attrs.frozen
class ShardPlan:
    """What rank `rank` of `world_size` keeps."""

    rank: int
    world_size: int
    num_heads: int  # local query heads
    num_kv_heads: int  # local KV heads
    kv_head_start: int  # the first global KV head it keeps
    intermediate_size: int  # local MLP features


def check_tensor_parallel(config: ModelConfig, world_size: int) -> None:
    """A `ValueError` naming the field when `world_size` ranks cannot split this model."""
    name = f"tensor_parallel_size={world_size}"
    if world_size < 1:
        raise ValueError(f"{name}: must be at least 1")
    if world_size == 1:
        return
    if config.num_heads % world_size:
        raise ValueError(
            f"{name} does not divide the {config.num_heads} query heads of {config.name}; "
            "use a divisor of the head count"
        )
    hkv = config.num_kv_heads
    if hkv % world_size and world_size % hkv:
        raise ValueError(
            f"{name} and the {hkv} KV heads of {config.name}: one must divide the other "
            "(KV heads are split, or replicated when there are fewer than ranks)"
        )
    if config.intermediate_size % world_size:
        raise ValueError(
            f"{name} does not divide intermediate_size={config.intermediate_size} of "
            f"{config.name}; use a divisor of it"
        )
    if config.mlp_kind == "moe":
        raise ValueError(
            f"{name}: {config.name} has mixture-of-experts layers, which are not sharded yet; "
            "run it with tensor_parallel_size=1"
        )
    state = [i for i, kind in enumerate(config.layer_kinds) if kind.kind == "linear_state"]
    if state:
        raise ValueError(
            f"{name}: {config.name} has linear-state layers ({state[:4]}), which are not "
            "sharded yet; run it with tensor_parallel_size=1"
        )


def shard_plan(config: ModelConfig, rank: int, world_size: int) -> ShardPlan:
    check_tensor_parallel(config, world_size)
    heads = config.num_heads // world_size
    group = config.num_heads // config.num_kv_heads  # query heads per KV head
    kv_heads = max(1, config.num_kv_heads // world_size)
    return ShardPlan(
        rank,
        world_size,
        heads,
        kv_heads,
        kv_head_start=rank * heads // group,
        intermediate_size=config.intermediate_size // world_size,
    )


def shard_config(config: ModelConfig, plan: ShardPlan) -> ModelConfig:
    """The config of one rank's model: local head counts and MLP width, same head size."""
    return attrs.evolve(
        config,
        num_heads=plan.num_heads,
        num_kv_heads=plan.num_kv_heads,
        intermediate_size=plan.intermediate_size,
    )


class RowParallelLinear(nn.Module):
    """`y = all_reduce(x @ W_r^T) + b`: the rank's input columns of a row-parallel
    projection; the bias (the full one, on every rank) is added after the sum."""

    def __init__(self, linear: nn.Linear, all_reduce: AllReduce) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.linear(x, self.weight)
        self.all_reduce(out)
        return out if self.bias is None else out + self.bias


@torch.no_grad()
def shard_decoder(
    full: DecoderModel, rank: int, world_size: int, all_reduce: AllReduce, **model_kwargs: Any
) -> DecoderModel:
    """Rank `rank`'s shard of `full`: a model of the local config with the full model's weights
    sliced into it, and row-parallel projections that all-reduce. `model_kwargs` go to
    `DecoderModel` (`backend_options`)."""
    plan = shard_plan(full.config, rank, world_size)
    backend_cls = type(next(iter(full.backends.values())))
    local = DecoderModel(
        shard_config(full.config, plan),
        backend_cls,
        dtype=full.dtype,
        device=full.device,
        **model_kwargs,
    )
    state = full.state_dict()
    for name, param in local.named_parameters():
        param.copy_(_slice(name, state[name], full.config, plan))
    for layer in local.model.layers:
        attn, mlp = cast(Any, layer).self_attn, cast(Any, layer).mlp
        attn.o_proj = RowParallelLinear(attn.o_proj, all_reduce)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, all_reduce)
    return local


def _slice(name: str, full: torch.Tensor, config: ModelConfig, plan: ShardPlan) -> torch.Tensor:
    """The rank's part of the full parameter `name`."""
    d = config.head_size
    q = _rows(plan.rank * plan.num_heads * d, plan.num_heads * d)
    kv = _rows(plan.kv_head_start * d, plan.num_kv_heads * d)
    inter = _rows(plan.rank * plan.intermediate_size, plan.intermediate_size)
    leaf = name.rsplit(".", 2)[-2:]  # e.g. ["q_proj", "weight"]
    module, kind = leaf[0], leaf[-1]
    if module == "q_proj":
        return q(full)
    if module in ("k_proj", "v_proj"):
        return kv(full)
    if module == "qkv_proj":
        qs, ks = config.num_heads * d, config.num_kv_heads * d
        parts = full.split([qs, ks, ks], dim=0)
        return torch.cat([q(parts[0]), kv(parts[1]), kv(parts[2])], dim=0)
    if module == "o_proj" and kind == "weight":
        return q(full.t()).t()
    if module in ("gate_proj", "up_proj"):
        return inter(full)
    if module == "gate_up_proj":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([inter(gate), inter(up)], dim=0)
    if module == "down_proj" and kind == "weight":
        return inter(full.t()).t()
    if name.endswith("self_attn.sinks"):
        return full[plan.rank * plan.num_heads : (plan.rank + 1) * plan.num_heads]
    return full  # replicated: embeddings, norms, q/k norms, the LM head, row-parallel biases


def _rows(start: int, count: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t[start : start + count]
