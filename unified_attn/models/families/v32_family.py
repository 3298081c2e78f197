"""DeepSeek-V3.2: MLA with DeepSeek Sparse Attention (layer kind "deepseek_v32", two cache users
per layer: the latent and the lightning indexer's keys), `DeepseekV32Config`,
`DeepseekV32ForCausalLM`; `plan` compares it, as DeepSeek-V3, with per-head keys and values of
`qk_head_dim`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from unified_attn.models.deepseek_config import DeepseekConfig
from unified_attn.models.deepseek_v32 import (
    INDEXER_ROLE,
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    v32_preset,
)
from unified_attn.models.deepseek_v32_hf import (
    deepseek_v32_config_from_hf,
    is_deepseek_v32,
    load_deepseek_v32,
)
from unified_attn.models.families.base import register_family
from unified_attn.models.families.mla_family import DeepseekMLAFamily
from unified_attn.models.presets import MLA_PRESETS
from unified_attn.models.real_shapes import REAL_V32_SHAPES

# DeepSeek-V3's test-scale preset with an indexer of 4 heads of 32 keeping 16 positions, so a
# 64-token prompt is attended sparsely.
V32_PRESETS = {
    "deepseek-v3.2-like": v32_preset(
        MLA_PRESETS["deepseek-v3-like"], "deepseek-v3.2-like",
        index_topk=16, index_head_dim=32, index_n_heads=4,
    ),
}  # fmt: skip


class DeepseekV32Family(DeepseekMLAFamily):
    name = "deepseek-v3.2"
    config_type = DeepseekV32Config
    layer_kind = "deepseek_v32"
    cache_users = (INDEXER_ROLE,)
    presets: dict[str, DeepseekConfig] = dict(V32_PRESETS)
    shapes: dict[str, DeepseekConfig] = dict(REAL_V32_SHAPES)
    hf_priority = 15
    model_cls = DeepseekV32ForCausalLM
    loader = staticmethod(load_deepseek_v32)
    hf_config_reader = staticmethod(deepseek_v32_config_from_hf)

    def reads_hf(self, hf: Mapping[str, Any]) -> bool:
        return is_deepseek_v32(dict(hf))

    def check_tensor_parallel(self, config: Any, world_size: int, model: str) -> None:
        raise ValueError(
            f"tensor_parallel_size={world_size}: {model!r} is a DeepSeek-V3.2 model, whose "
            "lightning indexer is not sharded yet; expected tensor_parallel_size=1"
        )

    def shard_config(self, config: Any, world_size: int) -> Any:
        self.check_tensor_parallel(config, world_size, config.name)

    def describe(self, config: Any) -> dict[str, Any]:
        """DeepSeek-V3's row plus the indexer."""
        row = super().describe(config)
        indexer = f"indexer {config.index_n_heads} x {config.index_head_dim}"
        kinds = row["layer_kinds"].replace("mla", "sparse mla")
        row["layer_kinds"] = f"{kinds}, {indexer} keeps {config.index_topk}"
        return row

    def theoretical_ratio(
        self, config: Any, max_model_len: int, max_in_flight_tokens: int,
        state_tokens: float,
    ) -> float:  # fmt: skip
        """Per-head keys and values over one latent and one indexer key, per token and layer."""
        per_token = config.latent_size + config.index_head_dim
        return float(2 * config.num_heads * config.qk_head_dim / per_token)


DEEPSEEK_V32 = register_family(DeepseekV32Family())
