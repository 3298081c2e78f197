"""Tensor-parallel shards of a decoder model (Megatron-style).

Rank `r` of `N` keeps query heads `[r * Hq/N, (r + 1) * Hq/N)` with the KV heads they read
(split when `Hkv >= N`, else one replicated head per rank; linear-state layers keep the same
heads for q, k, v, their gates and their recurrent state; gated delta-nets their key heads with
their value heads, `tensor_parallel_state.py`; a gated attention output its heads' gates), and
the same slice of every MLP's intermediate features (of every expert, in mixtures of experts).
Column-parallel projections (q/k/v, gate/up) keep their output rows; row-parallel ones
(`o_proj`, `down_proj`, a gated delta-net's `out_proj`) keep their input columns and sum the
ranks' partial outputs with one all-reduce each (`RowParallelLinear`, the bias added once after
it; a mixture of experts sums its whole output once, `ReducedOutput`).
The vocabulary is split too (padded to a multiple of the ranks): rank `r` keeps rows
`[r * V/N, (r + 1) * V/N)` of the embedding and of the LM head. The embedding looks up the ids
in its range, zeroes the others and all-reduces (`VocabParallelEmbedding`); the LM head's
partial logits are all-gathered into the full vocabulary (`DecoderModel.gather_logits`).
Norms and routers are replicated. Each rank's backends are built for its local head counts:
the backend contract is unchanged.

A shard is cut from a full model (`shard_decoder`), so its weights are exactly the full
model's: greedy tokens match the single-device model up to the float rounding of the sums.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import attrs
import torch
from torch import nn

from unified_attn.backend import AttentionBackend
from unified_attn.models.config import ModelConfig
from unified_attn.models.decoder import DecoderModel
from unified_attn.models.gated_delta import GatedDeltaNet
from unified_attn.models.mlp import MLP
from unified_attn.models.tensor_parallel_state import (
    check_gated_delta,
    shard_gated_delta_config,
    slice_gated_delta,
)

AllReduce = Callable[[torch.Tensor], None]  # sums a tensor over the ranks, in place
# [..., V/N] on each rank -> [..., V/N * N], the ranks' parts concatenated in rank order
AllGather = Callable[[torch.Tensor], torch.Tensor]


@attrs.frozen
class ShardPlan:
    """What rank `rank` of `world_size` keeps."""

    rank: int
    world_size: int
    num_heads: int  # local query heads
    num_kv_heads: int  # local KV heads
    kv_head_start: int  # the first global KV head it keeps
    intermediate_size: int  # local MLP features
    vocab_size: int  # local vocabulary rows (the vocabulary padded to a multiple of the ranks)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_size


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
    if config.gated_delta is not None:
        check_gated_delta(config.gated_delta, world_size, config.name)
    moe = config.moe
    for field in ("intermediate_size", "shared_expert_intermediate_size"):
        size = getattr(moe, field, None)
        if size is not None and size % world_size:
            raise ValueError(
                f"{name} does not divide the experts' {field}={size} of {config.name}; use a "
                "divisor of it"
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
        vocab_size=-(-config.vocab_size // world_size),
    )


def shard_config(config: ModelConfig, plan: ShardPlan) -> ModelConfig:
    """The config of one rank's model: local head counts, MLP width and vocabulary rows, same
    head size."""
    moe = config.moe
    if moe is not None:  # every expert keeps the same slice of its features
        n = plan.world_size
        moe = attrs.evolve(
            moe,
            intermediate_size=None if moe.intermediate_size is None else moe.intermediate_size // n,
            shared_expert_intermediate_size=None
            if moe.shared_expert_intermediate_size is None
            else moe.shared_expert_intermediate_size // n,
        )
    return attrs.evolve(
        config,
        num_heads=plan.num_heads,
        num_kv_heads=plan.num_kv_heads,
        intermediate_size=plan.intermediate_size,
        # the rank's slice of the vocabulary; special tokens stay the engine's (ModelSource)
        vocab_size=plan.vocab_size,
        bos_token_id=None,
        eos_token_id=None,
        moe=moe,
        gated_delta=None
        if config.gated_delta is None
        else shard_gated_delta_config(config.gated_delta, plan.world_size),
    )


class ReducedOutput(nn.Module):
    """A mixture of experts on a rank's slice of every expert's features: its output summed
    over the ranks (each expert's output is linear in its down projection's input)."""

    def __init__(self, module: nn.Module, all_reduce: AllReduce) -> None:
        super().__init__()
        self.module = module
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor, *args: Any) -> torch.Tensor:
        out = self.module(x, *args)  # args: e.g. DeepSeek-V4's token ids (hash routing)
        self.all_reduce(out)
        return out


class VocabParallelEmbedding(nn.Module):
    """The rank's rows `[start, start + V/N)` of the embedding: ids outside them embed to
    zeros, and the sum over the ranks is every id's own row (exact: one term is non-zero)."""

    def __init__(self, embedding: nn.Embedding, start: int, all_reduce: AllReduce) -> None:
        super().__init__()
        self.weight = embedding.weight
        self.start = start
        self.all_reduce = all_reduce

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = nn.functional.embedding(torch.where(inside, local, 0), self.weight)
        out.masked_fill_(~inside.unsqueeze(-1), 0)
        self.all_reduce(out)
        return out


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
    full: DecoderModel,
    rank: int,
    world_size: int,
    all_reduce: AllReduce,
    all_gather: AllGather,
    backend_cls: type[AttentionBackend],
    device: torch.device | str | None = None,
    **model_kwargs: Any,
) -> DecoderModel:
    """Rank `rank`'s shard of `full`: a model of the local config (attention layers on
    `backend_cls`, on `device`, default `full`'s) with the full model's weights sliced into it,
    row-parallel projections and the embedding that all-reduce, and logits all-gathered over
    the vocabulary. `model_kwargs` go to `DecoderModel` (`backend_options`)."""
    plan = shard_plan(full.config, rank, world_size)
    config = shard_config(full.config, plan)
    local = local_model(DecoderModel, config, full, backend_cls, device, model_kwargs)
    state = full.state_dict()
    for name, param in local.named_parameters():
        param.copy_(_slice(name, state[name], tuple(param.shape), full.config, plan))
    finish_shard(full, local, plan.vocab_start, all_reduce, all_gather)
    for layer in local.model.layers:
        attn = cast(Any, layer).self_attn
        if isinstance(attn, GatedDeltaNet):
            cast(Any, attn).out_proj = RowParallelLinear(attn.out_proj, all_reduce)
        else:
            attn.o_proj = RowParallelLinear(attn.o_proj, all_reduce)
        reduce_mlp(layer, all_reduce)
    return local


ModelT = TypeVar("ModelT")


def local_model(
    model_cls: Callable[..., ModelT],
    config: Any,
    full: Any,
    backend_cls: type[AttentionBackend],
    device: torch.device | str | None,
    model_kwargs: dict[str, Any],
) -> ModelT:
    """One rank's model of `config` (attention layers on `backend_cls`), in `full`'s dtype, on
    `device` (default `full`'s); `model_kwargs` go to the constructor (`backend_options`)."""
    return model_cls(
        config,
        backend_cls,
        dtype=full.dtype,
        device=full.device if device is None else device,
        **model_kwargs,
    )


def reduce_mlp(layer: Any, all_reduce: AllReduce) -> None:
    """A layer's MLP on the rank's features, summed over the ranks: a dense MLP's row-parallel
    `down_proj` all-reduces; experts (and shared experts) sum the whole block once."""
    mlp = layer.mlp
    if isinstance(mlp, MLP):
        cast(Any, mlp).down_proj = RowParallelLinear(mlp.down_proj, all_reduce)
    else:
        layer.mlp = ReducedOutput(mlp, all_reduce)


def finish_shard(
    full: Any, local: Any, vocab_start: int, all_reduce: AllReduce, all_gather: AllGather
) -> None:
    """What every family's shard does after its weights are sliced in: the embedding looks up
    the rank's vocabulary rows and all-reduces, the logits are all-gathered and cut to the
    vocabulary, and a checkpoint's fp8 KV scales (one K and one V scale per layer, for all its
    heads) reach the shard's layers unsplit, so every rank quantizes its heads with them."""
    local.model.embed_tokens = VocabParallelEmbedding(
        local.model.embed_tokens, vocab_start, all_reduce
    )
    vocab = full.config.vocab_size
    local.gather_logits = lambda logits: all_gather(logits)[..., :vocab]
    scales = {name: m.kv_scales for name, m in full.named_modules()
              if getattr(m, "kv_scales", None) is not None}  # fmt: skip
    for name, module in local.named_modules():
        if name in scales:
            module.kv_scales = scales[name].to(local.device)


def stacked_experts_slice(
    name: str, full: torch.Tensor, shape: tuple[int, ...], rank: int
) -> torch.Tensor | None:
    """The rank's features of `moe.RoutedExperts`' stacked weights (`experts.gate_up_proj
    [E, 2I, H]`: its part of the gate rows and of the up rows; `experts.down_proj [E, H, I]`),
    or None for any other parameter."""
    if name.endswith("experts.gate_up_proj"):
        gate, up = full.chunk(2, dim=1)
        part = slice(rank * shape[1] // 2, (rank + 1) * shape[1] // 2)
        return torch.cat([gate[:, part], up[:, part]], dim=1)
    if name.endswith("experts.down_proj"):
        return full[..., rank * shape[-1] : (rank + 1) * shape[-1]]
    return None


def _slice(
    name: str, full: torch.Tensor, shape: tuple[int, ...], config: ModelConfig, plan: ShardPlan
) -> torch.Tensor:
    """The rank's part of the full parameter `name`, whose local shape is `shape`. A column-
    parallel part is the rank's `shape`-sized run of output features; KV heads start at the
    rank's first KV head (replicated heads are shared by several ranks)."""
    r, d = plan.rank, config.head_size
    kv = _rows(plan.kv_head_start * d, plan.num_kv_heads * d)
    delta = _gated_delta_part(name, config)
    if delta is not None and config.gated_delta is not None:
        return slice_gated_delta(delta, full, config.gated_delta, r, plan.world_size)
    module, kind = name.rsplit(".", 2)[-2:]  # e.g. "q_proj", "weight"
    if config.moe is not None and config.moe.expert_kind == "swiglu":
        stacked = stacked_experts_slice(name, full, shape, r)
        if stacked is not None:
            return stacked
    if name.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):
        width = shape[-1]  # GPT-OSS: gate and up interleaved, so pairs stay together
        return full[..., r * width : (r + 1) * width]
    if name.endswith("experts.down_proj"):  # GPT-OSS [E, I, H]
        return full[:, r * shape[1] : (r + 1) * shape[1]]
    if name.endswith("experts.down_proj_bias"):  # added once: by rank 0
        return full if r == 0 else torch.zeros_like(full)
    if module in ("q_proj", "gate_proj", "up_proj", "g_proj"):
        return _rows(r * shape[0], shape[0])(full)
    if module in ("k_proj", "v_proj"):
        # attention: the KV heads its query heads read; linear-state layers: its own heads
        return (
            kv(full) if shape[0] == plan.num_kv_heads * d else _rows(r * shape[0], shape[0])(full)
        )
    if module == "qkv_proj":
        qs, ks = config.num_heads * d, config.num_kv_heads * d
        q, k, v = full.split([qs, ks, ks], dim=0)
        local_q = plan.num_heads * d
        return torch.cat([_rows(r * local_q, local_q)(q), kv(k), kv(v)], dim=0)
    if module == "gate_up_proj":
        half = shape[0] // 2
        gate, up = full.chunk(2, dim=0)
        return torch.cat([_rows(r * half, half)(gate), _rows(r * half, half)(up)], dim=0)
    if module in ("o_proj", "down_proj") and kind == "weight":
        return full[:, r * shape[1] : (r + 1) * shape[1]]
    if name.endswith("self_attn.sinks"):
        return full[r * plan.num_heads : (r + 1) * plan.num_heads]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):  # padded with zero rows
        rows = full[plan.vocab_start : plan.vocab_start + shape[0]]
        return torch.cat([rows, rows.new_zeros(shape[0] - len(rows), shape[1])])
    return full  # replicated: norms, routers, row-parallel biases


def _gated_delta_part(name: str, config: ModelConfig) -> str | None:
    """`in_proj_qkvz.weight`, ...: the part of a gated delta-net layer `name` names, else None."""
    if not name.startswith("model.layers."):
        return None
    index, rest = name.removeprefix("model.layers.").split(".", 1)
    if config.layer_kinds[int(index)].kind != "gated_delta":
        return None
    return rest.removeprefix("self_attn.") if rest.startswith("self_attn.") else None


def _rows(start: int, count: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t[start : start + count]
