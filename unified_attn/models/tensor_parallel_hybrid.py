"""Tensor-parallel shards of the state-space hybrids (`HybridModel`: Mamba2ForCausalLM, Bamba,
Nemotron-H, Granite-4.0-H), as `models/tensor_parallel.py` does for the Llama line.

Rank `r` of `N` keeps its heads of every Mamba-2 mixer (`tensor_parallel_state.py`: the groups
its heads read, the gated norm summed across ranks when a norm group spans them, `out_proj`
row-parallel), its query heads of every attention block with the KV heads they read (split,
or one replicated on `N / Hkv` ranks) and `o_proj` row-parallel, the same slice of the features
of every MLP, routed expert and shared expert (a mixture of experts summed once,
`ReducedOutput`, the shared expert's down bias added by rank 0), and its rows of the vocabulary.
Norms, routers and their correction biases are replicated.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from unified_attn.backend import AttentionBackend
from unified_attn.models.hybrid import HybridModel
from unified_attn.models.hybrid_config import HybridConfig
from unified_attn.models.hybrid_ffn import FeedForward
from unified_attn.models.layers import Attention
from unified_attn.models.mamba2_mixer import Mamba2Mixer
from unified_attn.models.tensor_parallel import (
    AllGather,
    AllReduce,
    ReducedOutput,
    RowParallelLinear,
    finish_shard,
    local_model,
    stacked_experts_slice,
)
from unified_attn.models.tensor_parallel_state import (
    Mamba2Shard,
    RankGatedRMSNorm,
    check_mamba2,
    shard_mamba2_config,
    splits,
)


def check_hybrid_tensor_parallel(config: HybridConfig, n: int, model: str) -> None:
    """A `ValueError` naming the field when `n` ranks cannot split this model's blocks."""
    name = f"tensor_parallel_size={n}"
    if n < 1:
        raise ValueError(f"{name}: must be at least 1")
    if n == 1:
        return
    if "mamba" in config.blocks:
        check_mamba2(config.mamba, n, model)
    if "attention" in config.blocks:
        _check_divides(n, config.num_heads, "attention heads (num_attention_heads)", model)
        if not splits(config.num_kv_heads, n):
            raise ValueError(
                f"{name} and the {config.num_kv_heads} KV heads of {model}: one must divide "
                "the other (KV heads are split, or replicated when there are fewer than ranks)"
            )
    for field, size in _feature_widths(config).items():
        _check_divides(n, size, f"features ({field})", model)


def _check_divides(n: int, count: int, what: str, model: str) -> None:
    if count % n:
        raise ValueError(
            f"tensor_parallel_size={n} does not divide the {count} {what} of {model}; use a "
            "divisor of it"
        )


def _feature_widths(config: HybridConfig) -> dict[str, int]:
    """The feature widths the ranks split: the dense MLPs', the experts' and shared experts'."""
    widths = {"intermediate_size": config.intermediate_size} if "mlp" in config.blocks else {}
    moe = config.moe
    if "moe" in config.blocks and moe is not None:
        widths["moe intermediate_size"] = moe.intermediate_size
        if moe.shared_intermediate_size is not None:
            widths["shared_intermediate_size"] = moe.shared_intermediate_size
    return widths


def shard_hybrid_config(config: HybridConfig, n: int, model: str | None = None) -> HybridConfig:
    """One rank's config: its Mamba heads and groups, attention heads, feature widths and
    vocabulary rows."""
    check_hybrid_tensor_parallel(config, n, config.name if model is None else model)
    fields: dict[str, Any] = {}
    if "attention" in config.blocks:
        fields.update(
            num_heads=config.num_heads // n, num_kv_heads=max(1, config.num_kv_heads // n)
        )
    if "mlp" in config.blocks:
        fields["intermediate_size"] = config.intermediate_size // n
    moe = config.moe
    if moe is not None:
        shared = moe.shared_intermediate_size
        fields["moe"] = attrs.evolve(moe, intermediate_size=moe.intermediate_size // n,
                                     shared_intermediate_size=None if shared is None
                                     else shared // n)  # fmt: skip
    return attrs.evolve(
        config,
        mamba=shard_mamba2_config(config.mamba, n) if "mamba" in config.blocks else config.mamba,
        vocab_size=-(-config.vocab_size // n),
        bos_token_id=None,  # special tokens stay the engine's (ModelSource)
        eos_token_id=None,
        **fields,
    )


@torch.no_grad()
def shard_hybrid(
    full: HybridModel,
    rank: int,
    world_size: int,
    all_reduce: AllReduce,
    all_gather: AllGather,
    backend_cls: type[AttentionBackend],
    device: torch.device | str | None = None,
    **model_kwargs: Any,
) -> HybridModel:
    """Rank `rank`'s shard of `full` (see the module docstring), on `device` (default `full`'s);
    `model_kwargs` go to `HybridModel` (`backend_options`)."""
    config = shard_hybrid_config(full.config, world_size)
    local = local_model(HybridModel, config, full, backend_cls, device, model_kwargs)
    state = {**dict(full.named_parameters()), **dict(full.named_buffers())}
    slicer = _Slicer(full.config, rank, world_size)
    for name, tensor in (*local.named_parameters(), *local.named_buffers()):
        tensor.copy_(slicer(name, state[name], tuple(tensor.shape)))
    finish_shard(full, local, rank * config.vocab_size, all_reduce, all_gather)
    mamba = Mamba2Shard(full.config.mamba, rank, world_size)
    for block in local.model.layers:
        _reduce_block(block, mamba, all_reduce)
    return local


def _reduce_block(block: Any, mamba: Mamba2Shard, all_reduce: AllReduce) -> None:
    """A block's mixer on the rank's part, its output summed over the ranks."""
    mixer = block.mixer
    if isinstance(mixer, Mamba2Mixer):
        _row_parallel(mixer, "out_proj", all_reduce)
        if mamba.norm_spans_ranks:
            mixer.norm = RankGatedRMSNorm(mixer.norm, mamba, all_reduce)
    elif isinstance(mixer, Attention):
        _row_parallel(mixer, "o_proj", all_reduce)
    elif isinstance(mixer, FeedForward):
        _row_parallel(mixer, "down_proj", all_reduce)
    else:  # a mixture of experts
        block.mixer = ReducedOutput(mixer, all_reduce)


def _row_parallel(module: Any, attr: str, all_reduce: AllReduce) -> None:
    setattr(module, attr, RowParallelLinear(getattr(module, attr), all_reduce))


@attrs.frozen
class _Slicer:
    """The rank's part of a full parameter or buffer, by the kind of its block."""

    config: HybridConfig
    rank: int
    world_size: int

    def __call__(self, name: str, full: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        if name in ("model.embed_tokens.weight", "lm_head.weight"):  # padded with zero rows
            rows = full[self.rank * shape[0] : (self.rank + 1) * shape[0]]
            return torch.cat([rows, rows.new_zeros(shape[0] - len(rows), shape[1])])
        if not name.startswith("model.layers."):
            return full  # the final norm
        index, rest = name.removeprefix("model.layers.").split(".", 1)
        if not rest.startswith("mixer."):
            return full  # the block's norm
        part, kind = rest.removeprefix("mixer."), self.config.blocks[int(index)]
        if kind == "mamba":
            return Mamba2Shard(self.config.mamba, self.rank, self.world_size).slice(part, full)
        if kind == "attention":
            return self._attention(part, full, shape)
        return self._features(part, full, shape)

    def _attention(self, part: str, full: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """Query heads and `o_proj` columns: the rank's run; K/V: the KV heads its query
        heads read (replicated heads are shared by several ranks)."""
        if part.startswith(("k_proj.", "v_proj.")):
            group = self.config.num_heads // self.config.num_kv_heads  # query heads per KV head
            heads = self.config.num_heads // self.world_size
            start = self.rank * heads // group * self.config.head_size
            return full.narrow(0, start, shape[0])
        return _rank_run(full, shape, self.rank)  # q_proj, o_proj; o_proj's bias replicated

    def _features(self, part: str, full: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """MLPs, experts and shared experts: the rank's slice of their features."""
        stacked = stacked_experts_slice(part, full, shape, self.rank)  # SwiGLU experts
        if stacked is not None:
            return stacked
        if part == "shared_experts.down_proj.bias":  # inside the one sum: added by rank 0
            return full if self.rank == 0 else torch.zeros_like(full)
        return _rank_run(full, shape, self.rank)  # routers and dense down biases: replicated


def _rank_run(full: torch.Tensor, shape: tuple[int, ...], rank: int) -> torch.Tensor:
    """The rank's run along the one dimension its part is narrower in (`full` itself when the
    shapes agree: a replicated tensor)."""
    narrower = [d for d, (a, b) in enumerate(zip(full.shape, shape, strict=True)) if a != b]
    if not narrower:
        return full
    (dim,) = narrower
    return full.narrow(dim, rank * shape[dim], shape[dim])


__all__ = ["check_hybrid_tensor_parallel", "shard_hybrid", "shard_hybrid_config"]
