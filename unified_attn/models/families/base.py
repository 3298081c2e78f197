"""The model-family seam: what the engine, `plan`, tensor parallelism and `models` need of a
family of models, declared once by the family (`ModelFamily`) and looked up here
(`family_of`, `family_of_preset`, `family_for_hf`). Nothing outside a family dispatches on a
model config type: a new family is a new module that calls `register_family`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from unified_attn.backend import AttentionBackend, AttentionType
from unified_attn.selector import SelectorConfig
from unified_attn.tensor_specs.paged import kv_cache_dtype_name

# what a model computes: the engine reads prompts and runs steps by it
ModelKind = Literal["decoder", "encoder_decoder", "encoder_only"]
# (head size, window, chunk, learned sinks, attention type): what backend selection needs of
# one kind of a model's attention layers
# (head size, sliding window, attention chunk, learned sinks, attention type, StreamingLLM sink
# tokens): one distinct attention kind of a model
AttentionKind = tuple[int, int | None, int | None, bool, AttentionType, int]
# `(LayerConfig, backend)` pairs, as `model.attention_layers()` yields them
Layers = list[tuple[Any, AttentionBackend]]


class ModelFamily:
    """One family of models. Subclass it, fill in the class attributes and the methods your
    family supports, and call `register_family(YourFamily())` in its module; the package's
    families are registered by `unified_attn.models.families`."""

    name: str = ""
    config_type: type = object  # the family's config class (exact type)
    model_kind: ModelKind = "decoder"
    layer_kind: str = "attention"  # `SelectorConfig.layer_kind` of its attention layers
    cache_users: tuple[str, ...] = ()  # `SelectorConfig.cache_users`
    presets: Mapping[str, Any] = {}  # preset name -> config (random weights, byte tokenizer)
    shapes: Mapping[str, Any] = {}  # real models' shapes that `plan` knows (no weights)
    hf_priority: int = 0  # checkpoints are offered to families by decreasing priority
    # what `plan` says of a checkpoint of this family it cannot plan (None: it plans it)
    plan_refusal: str | None = None

    # ---- configs ---------------------------------------------------------------------------

    def reads_hf(self, hf: Mapping[str, Any]) -> bool:
        """Whether a checkpoint's `config.json` (as a dict) is of this family."""
        return False

    # `config.json` (a dict) -> the family's config, called as `hf_config_reader(hf, name=)`;
    # None: the family reads none
    hf_config_reader: Any = None

    def config_from_hf(self, hf: Mapping[str, Any], name: str) -> Any:
        if self.hf_config_reader is None:
            raise ValueError(f"the {self.name} family reads no Hugging Face config")
        return self.hf_config_reader(dict(hf), name=name)

    def attention_kinds(self, config: Any) -> list[AttentionKind]:
        raise NotImplementedError

    def attention_soft_cap(self, config: Any) -> float | None:
        """The model's attention logits soft cap (None: its scores are not capped)."""
        return None

    def selector_configs(
        self, config: Any, dtype: torch.dtype, **fields: Any
    ) -> list[SelectorConfig]:
        """One `SelectorConfig` per distinct attention kind, with the family's layer kind and
        cache users; `fields` (device, block size, KV-cache dtype, batch-invariant mode) as
        given."""
        return [
            SelectorConfig(
                head_size=head_size,
                dtype=dtype,
                sliding_window=window,
                attention_chunk_size=chunk,
                has_sinks=sinks,
                num_sink_tokens=sink_tokens,
                logits_soft_cap=self.attention_soft_cap(config),
                attn_type=attn_type,
                layer_kind=self.layer_kind,
                cache_users=self.cache_users,
                **fields,
            )
            for head_size, window, chunk, sinks, attn_type, sink_tokens in self.attention_kinds(
                config
            )
        ]

    # ---- building and loading --------------------------------------------------------------

    # the model class, built as `model_cls(config, backend_cls, dtype=, device=,
    # backend_options=)`, and the checkpoint loader, called as `loader(path, backend_cls,
    # dtype=, device=, backend_options=) -> (model, tokenizer)`; None: the family has none
    model_cls: Any = None
    loader: Any = None

    def build(
        self,
        config: Any,
        backend_cls: type[AttentionBackend],
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        backend_options: dict[str, Any],
    ) -> Any:
        """The model of `config` with uninitialised weights (`device="meta"` to plan)."""
        if self.model_cls is None:
            raise ValueError(f"the {self.name} family builds no model from a config alone")
        return self.model_cls(
            config, backend_cls, dtype=dtype, device=device, backend_options=backend_options
        )

    def load(
        self,
        path: Path,
        backend_cls: type[AttentionBackend],
        *,
        dtype: torch.dtype,
        device: torch.device,
        backend_options: dict[str, Any],
    ) -> tuple[Any, Any]:
        """`(model, tokenizer)` of a checkpoint directory."""
        if self.loader is None:
            raise ValueError(f"the {self.name} family loads no checkpoint")
        return self.loader(
            path, backend_cls, dtype=dtype, device=device, backend_options=backend_options
        )

    def state_options(
        self, config: Any, mamba_cache_mode: str, num_speculative_blocks: int = 0
    ) -> dict[str, Any]:
        """Backend options for the model's state layers (the engine's `mamba_cache_mode`, and a
        state slot per draft token with speculative decoding); {} for a model without them.
        The model hands them to its state backends only (`STATE_OPTIONS`)."""
        return {}

    def source_fields(self, config: Any) -> dict[str, Any]:
        """What the engine needs to know beyond the vocabulary and EOS ids (encoder-decoder
        models: `decoder_start_token_id`, `max_encoder_len`)."""
        return {}

    # ---- tensor parallelism ----------------------------------------------------------------

    def check_tensor_parallel(self, config: Any, world_size: int, model: str) -> None:
        raise ValueError(
            f"tensor_parallel_size={world_size}: {model!r} is a {type(config).__name__} model; "
            "tensor parallelism serves decoder-only models (not encoder models yet); run it on "
            "one device"
        )

    def shard(self, model: Any, rank: int, world_size: int, *args: Any, **kwargs: Any) -> Any:
        """Rank `rank`'s shard of a built model (the family's tensor-parallel slicing)."""
        raise NotImplementedError

    def shard_config(self, config: Any, world_size: int) -> Any:
        """The config one rank holds (what `plan --tensor-parallel-size` plans)."""
        raise NotImplementedError

    # ---- describing and planning -----------------------------------------------------------

    def describe(self, config: Any) -> dict[str, Any]:
        """The row of `unified-attn models` for a preset."""
        raise NotImplementedError

    def full_attention_layers(
        self,
        config: Any,
        dtype: torch.dtype,
        kv_cache_dtype: str,
        reference: Mapping[str, type[AttentionBackend]],
    ) -> Layers:
        """The layers of the same model with full attention everywhere (what a non-hybrid
        allocator holds), built with the planner's `reference` classes ("paged": per-head K/V,
        "latent": one latent per token), on the meta device."""
        raise NotImplementedError

    def theoretical_ratio(
        self, config: Any, max_model_len: int, max_in_flight_tokens: int, state_tokens: float
    ) -> float:
        """Bytes per request with full allocation over the least the model must hold."""
        raise NotImplementedError


_FAMILIES: list[ModelFamily] = []


def register_family(family: ModelFamily) -> ModelFamily:
    """Declare a family (once; a family of the same name is replaced)."""
    _FAMILIES[:] = [f for f in _FAMILIES if f.name != family.name]
    _FAMILIES.append(family)
    return family


def families() -> list[ModelFamily]:
    """The registered families, in registration order."""
    return list(_FAMILIES)


def family_of(config: Any) -> ModelFamily:
    for family in _FAMILIES:
        if type(config) is family.config_type:
            return family
    raise ValueError(
        f"no model family takes a {type(config).__name__}; register one with "
        "unified_attn.models.families.register_family"
    )


def family_of_preset(name: str) -> ModelFamily | None:
    """The family of a preset or real-model shape called `name`, else None."""
    for family in _FAMILIES:
        if name in family.presets or name in family.shapes:
            return family
    return None


def family_for_hf(hf: Mapping[str, Any]) -> ModelFamily:
    """The family whose `reads_hf` takes this `config.json` (highest `hf_priority` first)."""
    for family in sorted(_FAMILIES, key=lambda f: -f.hf_priority):
        if family.reads_hf(hf):
            return family
    raise ValueError("no model family reads this config.json")


def preset_names() -> list[str]:
    return sorted(name for family in _FAMILIES for name in family.presets)


def shape_names() -> list[str]:
    return sorted(name for family in _FAMILIES for name in family.shapes)


def kv_cache_options(kv_cache_dtype: str) -> dict[str, Any]:
    """Backend keyword arguments for `kv_cache_dtype` as the engine takes it ("auto": none)."""
    if kv_cache_dtype == "auto":
        return {}
    return {"kv_cache_dtype": kv_cache_dtype_name(kv_cache_dtype)}
