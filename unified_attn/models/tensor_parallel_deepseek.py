"""Tensor-parallel shards of DeepSeek-V2/V3 (MLA + DeepSeekMoE), as `models/tensor_parallel.py`
does for the Llama-family decoders.

Rank `r` of `N` keeps query heads `[r * H/N, (r + 1) * H/N)`: their rows of `q_proj` (or
`q_b_proj`) and of the latent up-projection `kv_b_proj`, and their columns of `o_proj`, which
sums the ranks' partial outputs with one all-reduce. The latent down-projections
(`q_a_proj`, `kv_a_proj_with_mqa`) and their norms are replicated: every rank computes the same
latent `[c_kv, k_pe]` and caches all of it, so the latent cache is not split (one latent serves
every head; the per-rank cache holds as many tokens as one device's). MLPs keep a slice of every
expert's features (dense layers, routed experts and the shared experts alike), the router is
replicated, and a mixture of experts sums its whole output once. The vocabulary is split like
the decoders' (`VocabParallelEmbedding`, the logits all-gathered). Each rank's MLA backend sees
only its local head count: the backend contract is unchanged.
"""

from __future__ import annotations

from typing import Any, cast

import attrs
import torch

from unified_attn.backend import AttentionBackend
from unified_attn.models.deepseek import DeepseekDecoderLayer, DeepseekForCausalLM
from unified_attn.models.deepseek_config import DeepseekConfig
from unified_attn.models.mlp import MLP
from unified_attn.models.tensor_parallel import (
    AllGather,
    AllReduce,
    ReducedOutput,
    RowParallelLinear,
    VocabParallelEmbedding,
)

HEAD_ROWS = ("q_proj", "q_b_proj", "kv_b_proj")  # column-parallel by query head
FEATURE_ROWS = ("gate_proj", "up_proj")  # column-parallel by MLP feature


def check_deepseek_tensor_parallel(config: DeepseekConfig, world_size: int) -> None:
    """A `ValueError` naming the field when `world_size` ranks cannot split this model."""
    name = f"tensor_parallel_size={world_size}"
    if world_size < 1:
        raise ValueError(f"{name}: must be at least 1")
    for field in ("num_heads", "intermediate_size", "moe_intermediate_size"):
        size = getattr(config, field)
        if size % world_size:
            raise ValueError(
                f"{name} does not divide {field}={size} of {config.name}; use a divisor of it"
            )


def shard_deepseek_config(config: DeepseekConfig, world_size: int) -> DeepseekConfig:
    """One rank's config: local heads, MLP and expert widths, vocabulary rows."""
    check_deepseek_tensor_parallel(config, world_size)
    return attrs.evolve(
        config,
        num_heads=config.num_heads // world_size,
        intermediate_size=config.intermediate_size // world_size,
        moe_intermediate_size=config.moe_intermediate_size // world_size,
        vocab_size=-(-config.vocab_size // world_size),
        bos_token_id=None,  # special tokens stay the engine's (ModelSource)
        eos_token_ids=(),
    )


def shard_deepseek(
    full: DeepseekForCausalLM,
    rank: int,
    world_size: int,
    all_reduce: AllReduce,
    all_gather: AllGather,
    backend_cls: type[AttentionBackend],
    device: torch.device | str | None = None,
    **model_kwargs: Any,
) -> DeepseekForCausalLM:
    """Rank `rank`'s shard of `full` (see the module docstring), on `device` (default `full`'s);
    `model_kwargs` go to `DeepseekForCausalLM` (`backend_options`)."""
    config = shard_deepseek_config(full.config, world_size)
    local = DeepseekForCausalLM(
        config,
        backend_cls,
        dtype=full.dtype,
        device=full.device if device is None else device,
        **model_kwargs,
    )
    state = {**dict(full.named_parameters()), **dict(full.named_buffers())}
    with torch.no_grad():
        for name, tensor in (*local.named_parameters(), *local.named_buffers()):
            tensor.copy_(_slice(name, state[name], tuple(tensor.shape), rank, full.config))
    local.model.embed_tokens = VocabParallelEmbedding(  # type: ignore[assignment]
        local.model.embed_tokens, rank * config.vocab_size, all_reduce
    )
    vocab = full.config.vocab_size
    local.gather_logits = lambda logits: all_gather(logits)[..., :vocab]
    for layer in local.model.layers:
        layer = cast(DeepseekDecoderLayer, layer)
        attn = cast(Any, layer.self_attn)
        attn.o_proj = RowParallelLinear(attn.o_proj, all_reduce)
        if isinstance(layer.mlp, MLP):
            cast(Any, layer.mlp).down_proj = RowParallelLinear(layer.mlp.down_proj, all_reduce)
        else:  # routed and shared experts: one sum of the whole block
            layer.mlp = ReducedOutput(layer.mlp, all_reduce)
    return local


def _slice(
    name: str, full: torch.Tensor, shape: tuple[int, ...], rank: int, config: DeepseekConfig
) -> torch.Tensor:
    """The rank's part of the full parameter or buffer `name`, whose local shape is `shape`."""
    module, kind = name.rsplit(".", 2)[-2:]  # e.g. "kv_b_proj", "weight"
    if module in HEAD_ROWS or module in FEATURE_ROWS:
        return full[rank * shape[0] : (rank + 1) * shape[0]]
    if module in ("o_proj", "down_proj") and kind == "weight":
        return full[:, rank * shape[1] : (rank + 1) * shape[1]]
    if name.endswith("shared_experts.down_proj.bias"):  # inside the one sum: added by rank 0
        return full if rank == 0 else torch.zeros_like(full)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):  # padded with zero rows
        rows = full[rank * shape[0] : (rank + 1) * shape[0]]
        return torch.cat([rows, rows.new_zeros(shape[0] - len(rows), shape[1])])
    return full  # replicated: latent down-projections, norms, routers, row-parallel biases


__all__ = [
    "check_deepseek_tensor_parallel",
    "shard_deepseek",
    "shard_deepseek_config",
]
