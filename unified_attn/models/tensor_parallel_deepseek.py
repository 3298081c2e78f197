"""Tensor-parallel shards of DeepSeek-V2/V3 (MLA + DeepSeekMoE) and DeepSeek-V4, as
`models/tensor_parallel.py` does for the Llama-family decoders.

Rank `r` of `N` keeps query heads `[r * H/N, (r + 1) * H/N)`: their rows of `q_proj` (or
`q_b_proj`), of MLA's latent up-projection `kv_b_proj`, and of V4's learned sinks and grouped
output projection `o_a_proj` (its `o_groups / N` groups), and their columns of the row-parallel
`o_proj` (V4: `o_b_proj`), which sums the ranks' partial outputs with one all-reduce. What
produces the one shared latent is replicated: MLA's down-projections (`q_a_proj`,
`kv_a_proj_with_mqa`) and norms, V4's `kv_proj`, its compressors and its lightning indexer (whose
top-k every rank computes alike). Every rank therefore caches the whole latent (and V4's
compressed entries and indexer keys): the caches are not split, a rank's cache holds as many
tokens as one device's. MLPs keep a slice of every expert's features (dense layers, routed and
shared experts), routers and hash tables are replicated, and a mixture of experts sums its whole
output once. Hyper-connections and norms are replicated. The vocabulary is split like the
decoders' (`VocabParallelEmbedding`, the logits all-gathered). Each rank's backends see only its
local head count: the backend contract is unchanged.
"""

from __future__ import annotations

from typing import Any, TypeVar, cast

import attrs
import torch

from unified_attn.backend import AttentionBackend
from unified_attn.models.deepseek import DeepseekForCausalLM
from unified_attn.models.deepseek_config import DeepseekConfig
from unified_attn.models.deepseek_v4 import DeepseekV4Config, DeepseekV4ForCausalLM
from unified_attn.models.tensor_parallel import (
    AllGather,
    AllReduce,
    RowParallelLinear,
    finish_shard,
    local_model,
    reduce_mlp,
    stacked_experts_slice,
)

DeepseekConfigs = TypeVar("DeepseekConfigs", DeepseekConfig, DeepseekV4Config)
DeepseekModels = TypeVar("DeepseekModels", DeepseekForCausalLM, DeepseekV4ForCausalLM)

# Attention parameters split by query head: their rows (`o_a_proj`: its groups' rows; the
# indexer's own `q_b_proj` is replicated, so the names are matched from `self_attn.` on).
HEAD_ROWS = tuple(
    f"self_attn.{name}"
    for name in ("q_proj.weight", "q_b_proj.weight", "kv_b_proj.weight", "sinks", "o_a_proj.weight")
)
HEAD_COLUMNS = ("self_attn.o_proj.weight", "self_attn.o_b_proj.weight")  # row-parallel


def check_deepseek_tensor_parallel(
    config: DeepseekConfig | DeepseekV4Config, n: int, split: tuple[str, ...]
) -> None:
    """A `ValueError` naming the field when `n` ranks cannot split this model: its heads,
    expert width and the family's other `split` fields (V2/V3: the dense MLP's
    `intermediate_size`; V4: `o_groups`)."""
    name = f"tensor_parallel_size={n}"
    if n < 1:
        raise ValueError(f"{name}: must be at least 1")
    for field in ("num_heads", "moe_intermediate_size", *split):
        size = getattr(config, field)
        if size % n:
            raise ValueError(
                f"{name} does not divide {field}={size} of {config.name}; use a divisor of it"
            )


def shard_deepseek_config(
    config: DeepseekConfigs, world_size: int, split: tuple[str, ...]
) -> DeepseekConfigs:
    """One rank's config: local heads, expert widths, vocabulary rows and the family's `split`
    fields (the dense MLP width, or V4's output groups)."""
    n = world_size
    check_deepseek_tensor_parallel(config, n, split)
    local: dict[str, Any] = {field: getattr(config, field) // n for field in split}
    return attrs.evolve(
        config,
        num_heads=config.num_heads // n,
        moe_intermediate_size=config.moe_intermediate_size // n,
        vocab_size=-(-config.vocab_size // n),
        bos_token_id=None,  # special tokens stay the engine's (ModelSource)
        eos_token_ids=(),
        **local,
    )


def shard_deepseek(
    full: DeepseekModels,
    rank: int,
    world_size: int,
    all_reduce: AllReduce,
    all_gather: AllGather,
    backend_cls: type[AttentionBackend],
    device: torch.device | str | None = None,
    *,
    split: tuple[str, ...],
    **model_kwargs: Any,
) -> DeepseekModels:
    """Rank `rank`'s shard of `full` (see the module docstring), on `device` (default `full`'s),
    splitting the family's `split` fields (`shard_deepseek_config`); `model_kwargs` go to the
    model's constructor (`backend_options`)."""
    config = shard_deepseek_config(full.config, world_size, split)
    local: Any = local_model(type(full), config, full, backend_cls, device, model_kwargs)
    state = {**dict(full.named_parameters()), **dict(full.named_buffers())}
    with torch.no_grad():
        for name, tensor in (*local.named_parameters(), *local.named_buffers()):
            if name.endswith("tid2eid"):  # V4's hash routing: one row per id of the vocabulary
                module, attr = name.rsplit(".", 1)
                setattr(local.get_submodule(module), attr, state[name].to(tensor.device).clone())
            else:
                tensor.copy_(_slice(name, state[name], tuple(tensor.shape), rank))
    finish_shard(full, local, rank * config.vocab_size, all_reduce, all_gather)
    for layer in local.model.layers:
        attn = layer.self_attn
        if isinstance(full, DeepseekForCausalLM):
            attn.o_proj = RowParallelLinear(attn.o_proj, all_reduce)
        else:
            attn.o_b_proj = RowParallelLinear(attn.o_b_proj, all_reduce)
        reduce_mlp(layer, all_reduce)
    return cast(DeepseekModels, local)


def _slice(name: str, full: torch.Tensor, shape: tuple[int, ...], rank: int) -> torch.Tensor:
    """The rank's part of the full parameter or buffer `name`, whose local shape is `shape`."""
    if name.endswith(HEAD_ROWS):
        return full[rank * shape[0] : (rank + 1) * shape[0]]
    if name.endswith(HEAD_COLUMNS):
        return full[:, rank * shape[1] : (rank + 1) * shape[1]]
    if ".mlp." in name:
        return _slice_mlp(name, full, shape, rank)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):  # padded with zero rows
        rows = full[rank * shape[0] : (rank + 1) * shape[0]]
        return torch.cat([rows, rows.new_zeros(shape[0] - len(rows), shape[1])])
    # replicated: latent and compressor projections, the indexer, norms, hyper-connections
    return full


def _slice_mlp(name: str, full: torch.Tensor, shape: tuple[int, ...], rank: int) -> torch.Tensor:
    """Dense MLPs, experts and shared experts: the rank's slice of their features."""
    module, kind = name.rsplit(".", 2)[-2:]  # e.g. "gate_proj", "weight"
    stacked = stacked_experts_slice(name, full, shape, rank)  # the routed experts
    if stacked is not None:
        return stacked
    if module in ("gate_proj", "up_proj"):
        return full[rank * shape[0] : (rank + 1) * shape[0]]
    if module == "down_proj" and kind == "weight":
        return full[:, rank * shape[1] : (rank + 1) * shape[1]]
    if name.endswith("shared_experts.down_proj.bias"):  # inside the one sum: added by rank 0
        return full if rank == 0 else torch.zeros_like(full)
    return full  # routers, hash tables, the dense MLP's down bias (added after its sum)


__all__ = [
    "check_deepseek_tensor_parallel",
    "shard_deepseek",
    "shard_deepseek_config",
]
