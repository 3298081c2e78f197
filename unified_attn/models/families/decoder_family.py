"""Decoder-only models of the Llama line (Llama, Mistral, Qwen 2/3, Phi-3, Gemma 2/3, GPT-OSS,
Mixtral, Qwen2-MoE, Llama 4, the presets): `ModelConfig`, `DecoderModel`, every layer kind (full,
sliding, chunked, sinks, state). Also what `plan` needs of them: full attention on every layer
(`all_full`) and the ideal per-layer allocation."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from unified_attn.backend import AttentionBackend, AttentionType
from unified_attn.backend.state_layers import state_options
from unified_attn.models.config import LayerKind, ModelConfig
from unified_attn.models.decoder import DecoderModel
from unified_attn.models.families.base import (
    AttentionKind,
    Layers,
    ModelFamily,
    kv_cache_options,
    register_family,
)
from unified_attn.models.hf import config_from_hf, load_hf_model
from unified_attn.models.presets import PRESETS
from unified_attn.models.real_shapes import REAL_SHAPES
from unified_attn.models.tensor_parallel import (
    check_tensor_parallel,
    shard_config,
    shard_decoder,
    shard_plan,
)


def all_full(config: ModelConfig) -> ModelConfig:
    """The same model with full attention on every layer (what a non-hybrid manager allocates)."""
    return attrs.evolve(config, layer_kinds=[LayerKind.full()] * config.num_layers)


def ideal_tokens(kind: LayerKind, max_model_len: int, in_flight: int) -> int:
    """Tokens one layer of `kind` must hold for a request of `max_model_len` tokens."""
    if kind.window is not None:
        return min(kind.window - 1 + kind.sink_tokens + in_flight, max_model_len)
    if kind.chunk is not None:
        return min(kind.chunk + in_flight, max_model_len)
    return max_model_len


DECODER = AttentionType.DECODER


class DecoderFamily(ModelFamily):
    name = "decoder"
    config_type = ModelConfig
    presets = PRESETS
    shapes = REAL_SHAPES
    hf_priority = -100  # the fallback: every other family looks first
    model_cls = DecoderModel
    loader = staticmethod(load_hf_model)
    hf_config_reader = staticmethod(config_from_hf)

    def reads_hf(self, hf: Mapping[str, Any]) -> bool:
        return True  # config_from_hf names what it cannot read

    def attention_kinds(self, config: ModelConfig) -> list[AttentionKind]:
        """Its distinct attention kinds (state layers select their own backend in
        `DecoderModel`)."""
        attention = [k for k in config.layer_kinds if not k.is_state]
        return list(
            dict.fromkeys(
                (config.head_size, k.window, k.chunk, k.has_sinks, DECODER, k.sink_tokens)
                for k in attention or [LayerKind.full()]
            )
        )

    def state_options(
        self, config: ModelConfig, mamba_cache_mode: str, num_speculative_blocks: int = 0
    ) -> dict[str, Any]:
        if any(kind.is_state for kind in config.layer_kinds):
            return state_options(mamba_cache_mode, num_speculative_blocks)
        return {}

    def attention_soft_cap(self, config: ModelConfig) -> float | None:
        return config.attn_logit_softcap

    def check_tensor_parallel(self, config: ModelConfig, world_size: int, model: str) -> None:
        check_tensor_parallel(config, world_size)

    def shard(self, model: Any, rank: int, world_size: int, *args: Any, **kwargs: Any) -> Any:
        return shard_decoder(model, rank, world_size, *args, **kwargs)

    def shard_config(self, config: ModelConfig, world_size: int) -> ModelConfig:
        return shard_config(config, shard_plan(config, 0, world_size))

    def describe(self, config: ModelConfig) -> dict[str, Any]:
        return {
            "name": config.name,
            "layers": config.num_layers,
            "layer_kinds": describe_layer_kinds(config),
            "heads": f"{config.num_heads} / {config.num_kv_heads} KV x {config.head_size}",
            "max_position_embeddings": config.max_position_embeddings,
        }

    def full_attention_layers(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        kv_cache_dtype: str,
        reference: Mapping[str, type[AttentionBackend]],
    ) -> Layers:
        model = DecoderModel(all_full(config), reference["paged"], dtype=dtype, device="meta",
                             backend_options=kv_cache_options(kv_cache_dtype))  # fmt: skip
        return list(model.attention_layers())

    def theoretical_ratio(
        self, config: ModelConfig, max_model_len: int, max_in_flight_tokens: int,
        state_tokens: float,
    ) -> float:  # fmt: skip
        """Bytes per request with full allocation over bytes with ideal per-layer allocation
        (no group padding, token-exact windows, sink tokens kept, one state per state layer):
        the most the hybrid manager can gain. `state_tokens`: a state layer's state in tokens
        of one full layer's KV (full allocation makes the state layers full attention
        layers)."""
        in_flight = min(max_in_flight_tokens, max_model_len)
        ideal = sum(
            state_tokens if kind.is_state else ideal_tokens(kind, max_model_len, in_flight)
            for kind in config.layer_kinds
        )
        return config.num_layers * max_model_len / ideal if ideal else float("inf")


def describe_layer_kinds(config: ModelConfig) -> str:
    """`full x2, sliding 32 x2`: each distinct layer kind with its count, in order."""
    counts: dict[str, int] = {}
    for kind in config.layer_kinds:
        label = layer_kind_label(kind)
        counts[label] = counts.get(label, 0) + 1
    return ", ".join(f"{label} x{n}" for label, n in counts.items())


def layer_kind_label(kind: LayerKind) -> str:
    label = kind.kind.replace("_", " ")
    if kind.window is not None:
        label += f" {kind.window}"
    if kind.chunk is not None:
        label += f" {kind.chunk}"
    if kind.sink_tokens:
        label += f" + {kind.sink_tokens} sink tokens"
    if kind.has_sinks:
        label += " (learned sinks)"
    return label


DECODERS = register_family(DecoderFamily())
