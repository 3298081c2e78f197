"""DeepSeek-V4: a sliding window of latents plus compressed caches per layer (layer kind
"deepseek_v4", several cache users), `DeepseekV4Config`, `DeepseekV4ForCausalLM`; `plan`
compares it with one full latent per token and layer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from unified_attn.backend import AttentionBackend, AttentionType, LayerConfig
from unified_attn.models.deepseek_v4 import (
    CACHE_USER_ROLES,
    DeepseekV4Config,
    DeepseekV4ForCausalLM,
)
from unified_attn.models.deepseek_v4_hf import deepseek_v4_config_from_hf, load_deepseek_v4
from unified_attn.models.families.base import AttentionKind, Layers, register_family
from unified_attn.models.families.mla_family import DeepseekFamilyBase
from unified_attn.models.hf_config import is_deepseek_v4
from unified_attn.models.presets import V4_PRESETS
from unified_attn.models.real_shapes import REAL_V4_SHAPES

KIND_LABELS = {"sliding_attention": "sliding", "compressed_sparse_attention": "CSA",
               "heavily_compressed_attention": "HCA"}  # fmt: skip


class DeepseekV4Family(DeepseekFamilyBase):
    name = "deepseek-v4"
    config_type = DeepseekV4Config
    layer_kind = "deepseek_v4"
    split = ("o_groups",)  # the grouped output projection
    cache_users = CACHE_USER_ROLES
    presets = V4_PRESETS
    shapes = REAL_V4_SHAPES
    hf_priority = 20
    model_cls = DeepseekV4ForCausalLM
    loader = staticmethod(load_deepseek_v4)
    hf_config_reader = staticmethod(deepseek_v4_config_from_hf)

    def reads_hf(self, hf: Mapping[str, Any]) -> bool:
        return is_deepseek_v4(dict(hf))

    def attention_kinds(self, config: DeepseekV4Config) -> list[AttentionKind]:
        """A sliding latent (and compressed caches), learned sinks."""
        return [(config.head_dim, config.sliding_window, None, True, AttentionType.DECODER, 0)]

    def describe(self, config: DeepseekV4Config) -> dict[str, Any]:
        """Its attention pattern and caches."""
        counts: dict[str, int] = {}
        for kind in config.layer_types:
            counts[KIND_LABELS[kind]] = counts.get(KIND_LABELS[kind], 0) + 1
        return {
            "name": config.name,
            "layers": config.num_layers,
            "layer_kinds": ", ".join(f"{k} x{n}" for k, n in counts.items())
            + f" (window {config.sliding_window}, rates {config.csa_compress_rate} / "
            f"{config.hca_compress_rate})",
            "heads": f"{config.num_heads} / shared KV x {config.head_dim}",
            "max_position_embeddings": config.max_position_embeddings,
        }

    def full_attention_layers(
        self,
        config: DeepseekV4Config,
        dtype: torch.dtype,
        kv_cache_dtype: str,
        reference: Mapping[str, type[AttentionBackend]],
    ) -> Layers:
        """Without windows or compression: one `head_dim` latent per token and layer (shared
        K = V), kept for the whole request, in the model dtype."""
        rope = config.qk_rope_head_dim
        latent: Any = reference["latent"]
        backend = latent(head_size=config.head_dim, dtype=dtype,
                         kv_lora_rank=config.head_dim - rope)  # fmt: skip
        scale = config.head_dim**-0.5
        heads, dim = config.num_heads, config.head_dim
        return [
            (LayerConfig(f"model.layers.{i}.self_attn", heads, 1, dim, scale), backend)
            for i in range(config.num_layers)
        ]

    def theoretical_ratio(
        self, config: DeepseekV4Config, max_model_len: int, max_in_flight_tokens: int,
        state_tokens: float,
    ) -> float:  # fmt: skip
        """Full latents over the least a request must hold (values per layer): its window, the
        compressed entries and indexer keys, and the compressors' raw rows."""
        length = max_model_len
        in_flight = min(max_in_flight_tokens, max_model_len)

        def tokens(window: int) -> int:
            return min(window - 1 + in_flight, length)

        dim, idx = config.head_dim, config.index_head_dim
        ideal = float(config.num_layers * tokens(config.sliding_window) * dim)
        csa, hca = config.csa_compress_rate, config.hca_compress_rate
        ideal += config.layer_count("compressed_sparse_attention") * (
            length / csa * (dim + idx) + tokens(2 * csa) * 2 * (2 * dim + 2 * idx)
        )
        ideal += config.layer_count("heavily_compressed_attention") * (
            length / hca * dim + tokens(hca) * 2 * dim
        )
        return config.num_layers * length * dim / ideal


DEEPSEEK_V4 = register_family(DeepseekV4Family())
