"""DeepSeek-V2/V3: multi-head latent attention (one latent per token, layer kind "mla"),
`DeepseekConfig`, `DeepseekForCausalLM`; `plan` compares the latent with per-head keys and
values of `qk_head_dim`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from unified_attn.backend import AttentionBackend, AttentionType, LayerConfig
from unified_attn.models.deepseek import DeepseekForCausalLM
from unified_attn.models.deepseek_config import DeepseekConfig
from unified_attn.models.deepseek_hf import deepseek_config_from_hf, load_deepseek
from unified_attn.models.families.base import (
    AttentionKind,
    Layers,
    ModelFamily,
    kv_cache_options,
    register_family,
)
from unified_attn.models.hf_config import mla_version
from unified_attn.models.presets import MLA_PRESETS
from unified_attn.models.real_shapes import REAL_MLA_SHAPES
from unified_attn.models.tensor_parallel_deepseek import (
    check_deepseek_tensor_parallel,
    shard_deepseek,
    shard_deepseek_config,
)


class DeepseekFamilyBase(ModelFamily):
    """What DeepSeek-V2/V3 and V4 share: presets built with random weights, sharding by heads
    with the latent caches replicated."""

    # the fields besides heads and expert width that ranks split
    split: tuple[str, ...] = ()

    def check_tensor_parallel(self, config: Any, world_size: int, model: str) -> None:
        check_deepseek_tensor_parallel(config, world_size, self.split)

    def shard(self, model: Any, rank: int, world_size: int, *args: Any, **kwargs: Any) -> Any:
        return shard_deepseek(model, rank, world_size, *args, split=self.split, **kwargs)

    def shard_config(self, config: Any, world_size: int) -> Any:
        return shard_deepseek_config(config, world_size, self.split)


class DeepseekMLAFamily(DeepseekFamilyBase):
    name = "deepseek-mla"
    config_type = DeepseekConfig
    layer_kind = "mla"
    split = ("intermediate_size",)  # the dense MLP layers
    presets = MLA_PRESETS
    shapes = REAL_MLA_SHAPES
    hf_priority = 10
    model_cls = DeepseekForCausalLM
    loader = staticmethod(load_deepseek)
    hf_config_reader = staticmethod(deepseek_config_from_hf)

    def reads_hf(self, hf: Mapping[str, Any]) -> bool:
        return mla_version(dict(hf)) is not None

    def attention_kinds(self, config: DeepseekConfig) -> list[AttentionKind]:
        return [(config.latent_size, None, None, False, AttentionType.DECODER, 0)]

    def describe(self, config: DeepseekConfig) -> dict[str, Any]:
        """Its MLP pattern and latent width."""
        dense = config.first_k_dense_replace
        moe = config.num_layers - dense
        return {
            "name": config.name,
            "layers": config.num_layers,
            "layer_kinds": f"mla x{config.num_layers} (dense MLP x{dense}, MoE x{moe})",
            "heads": f"{config.num_heads} / latent {config.kv_lora_rank} + "
            f"{config.qk_rope_head_dim}",
            "max_position_embeddings": config.max_position_embeddings,
        }

    def full_attention_layers(
        self,
        config: DeepseekConfig,
        dtype: torch.dtype,
        kv_cache_dtype: str,
        reference: Mapping[str, type[AttentionBackend]],
    ) -> Layers:
        """Without the latent: per-head keys and values of `qk_head_dim` each (values padded to
        the key size) in every layer."""
        heads, head = config.num_heads, config.qk_head_dim
        backend = reference["paged"](num_kv_heads=heads, head_size=head, dtype=dtype,
                                     **kv_cache_options(kv_cache_dtype))  # fmt: skip
        return [
            (LayerConfig(f"model.layers.{i}.self_attn", heads, heads, head, config.softmax_scale),
             backend)
            for i in range(config.num_layers)
        ]  # fmt: skip

    def theoretical_ratio(
        self, config: DeepseekConfig, max_model_len: int, max_in_flight_tokens: int,
        state_tokens: float,
    ) -> float:  # fmt: skip
        """Per-head keys and values over one latent, per token and layer."""
        return 2 * config.num_heads * config.qk_head_dim / config.latent_size


DEEPSEEK_MLA = register_family(DeepseekMLAFamily())
