"""State-space hybrids (Mamba2ForCausalLM, Bamba, Nemotron-H, Granite-4.0-H): Mamba-2 state
layers, each in a state group of `StateManager`, beside full-attention layers. `plan` compares
them with the same model holding full attention in every layer with a cache."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from unified_attn.backend import AttentionBackend, AttentionType, LayerConfig
from unified_attn.backend.state_layers import state_options
from unified_attn.models.families.base import (
    AttentionKind,
    Layers,
    ModelFamily,
    kv_cache_options,
    register_family,
)
from unified_attn.models.hf_config import is_hybrid
from unified_attn.models.hybrid import HybridModel
from unified_attn.models.hybrid_config import HybridConfig
from unified_attn.models.hybrid_hf import hybrid_config_from_hf, load_hybrid
from unified_attn.models.hybrid_shapes import HYBRID_PRESETS, HYBRID_SHAPES
from unified_attn.models.tensor_parallel_hybrid import (
    check_hybrid_tensor_parallel,
    shard_hybrid,
    shard_hybrid_config,
)

CACHE_BLOCKS = ("mamba", "attention")  # the blocks that hold a cache (not MLP or MoE)


def _full_shape(config: HybridConfig) -> tuple[int, int]:
    """(KV heads, head size) a layer holds under full allocation: the attention blocks', or
    for a model without attention, the Mamba heads as keys and values."""
    if "attention" in config.blocks:
        return config.num_kv_heads, config.head_size
    return config.mamba.num_heads, config.mamba.head_size


class HybridFamily(ModelFamily):
    name = "state-space-hybrid"
    config_type = HybridConfig
    presets = HYBRID_PRESETS
    shapes = HYBRID_SHAPES
    hf_priority = 10
    model_cls = HybridModel
    loader = staticmethod(load_hybrid)
    hf_config_reader = staticmethod(hybrid_config_from_hf)

    def reads_hf(self, hf: Mapping[str, Any]) -> bool:
        return is_hybrid(dict(hf))

    def attention_kinds(self, config: HybridConfig) -> list[AttentionKind]:
        """Its one attention kind (a model without attention blocks still selects a class;
        its state layers take the state backend whatever it is)."""
        heads = _full_shape(config)[1]
        return [(heads, None, None, False, AttentionType.DECODER, 0)]

    def state_options(
        self, config: HybridConfig, mamba_cache_mode: str, num_speculative_blocks: int = 0
    ) -> dict[str, Any]:
        return state_options(mamba_cache_mode, num_speculative_blocks)

    def check_tensor_parallel(self, config: HybridConfig, world_size: int, model: str) -> None:
        check_hybrid_tensor_parallel(config, world_size, repr(model))

    def shard(self, model: Any, rank: int, world_size: int, *args: Any, **kwargs: Any) -> Any:
        return shard_hybrid(model, rank, world_size, *args, **kwargs)

    def shard_config(self, config: HybridConfig, world_size: int) -> HybridConfig:
        return shard_hybrid_config(config, world_size)

    def describe(self, config: HybridConfig) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for kind in config.blocks:
            counts[kind] = counts.get(kind, 0) + 1
        m = config.mamba
        return {
            "name": config.name,
            "layers": config.num_layers,
            "layer_kinds": ", ".join(f"{kind} x{n}" for kind, n in counts.items()),
            "heads": (f"{config.num_heads} / {config.num_kv_heads} KV x {config.head_size}; "
                      if "attention" in config.blocks else "")
            + f"Mamba {m.num_heads} x {m.head_size}, state {m.state_size}",
            "max_position_embeddings": config.max_position_embeddings,
        }

    def full_attention_layers(
        self,
        config: HybridConfig,
        dtype: torch.dtype,
        kv_cache_dtype: str,
        reference: Mapping[str, type[AttentionBackend]],
    ) -> Layers:
        """Every Mamba and attention block as a full-attention layer."""
        kv_heads, head = _full_shape(config)
        backend = reference["paged"](num_kv_heads=kv_heads, head_size=head, dtype=dtype,
                                     **kv_cache_options(kv_cache_dtype))  # fmt: skip
        return [
            (LayerConfig(f"layers.{i}.mixer", kv_heads, kv_heads, head, head**-0.5), backend)
            for i, kind in enumerate(config.blocks)
            if kind in CACHE_BLOCKS
        ]

    def theoretical_ratio(
        self, config: HybridConfig, max_model_len: int, max_in_flight_tokens: int,
        state_tokens: float,
    ) -> float:  # fmt: skip
        """Full attention in every cache layer over one state per Mamba layer and the whole
        context in each attention layer."""
        cached = [kind for kind in config.blocks if kind in CACHE_BLOCKS]
        ideal = sum(state_tokens if kind == "mamba" else max_model_len for kind in cached)
        return len(cached) * max_model_len / ideal if ideal else float("inf")


HYBRIDS = register_family(HybridFamily())
