"""Turn an engine's `model` argument (a preset name or a checkpoint path) into a model with its
backend selected, its weights and its tokenizer.

The backend is named as everywhere else (`selector.resolve_backend`) and selected for every
distinct attention kind of the model (`selector_configs`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import attrs
import torch

from unified_attn.backend import AttentionBackend, AttentionType
from unified_attn.models import (
    MLA_PRESETS,
    PRESETS,
    V4_PRESETS,
    ByteTokenizer,
    DecoderModel,
    LayerKind,
    ModelConfig,
    get_preset,
)
from unified_attn.models.bart import BartConfig
from unified_attn.models.bert import BertConfig
from unified_attn.models.deepseek import DeepseekForCausalLM
from unified_attn.models.deepseek_config import DeepseekConfig
from unified_attn.models.deepseek_hf import deepseek_config_from_hf, load_deepseek
from unified_attn.models.deepseek_v4 import (
    CACHE_USER_ROLES,
    DeepseekV4Config,
    DeepseekV4ForCausalLM,
)
from unified_attn.models.deepseek_v4_hf import deepseek_v4_config_from_hf, load_deepseek_v4
from unified_attn.models.hf import config_from_hf, load_hf_model, read_hf_config
from unified_attn.models.hf_config import encoder_family, is_deepseek_v4, mla_version
from unified_attn.models.hf_encoders import (
    bart_config_from_hf,
    bert_config_from_hf,
    load_bart,
    load_bert,
)
from unified_attn.selector import SelectorConfig, select_backend
from unified_attn.tensor_specs import as_dtype
from unified_attn.tensor_specs.paged import kv_cache_dtype_name

# what a model computes: the engine reads prompts and runs steps by it
ModelKind = Literal["decoder", "encoder_decoder", "encoder_only"]

DEFAULT_MODEL = "tiny-llama"  # `LLMEngine`'s and `unified-attn run`'s default


@attrs.frozen
class ModelSource:
    """A loaded model with what the engine needs to know about it."""

    model: Any  # DecoderModel, EncoderDecoderModel or BertEncoderModel
    tokenizer: Any
    backend_cls: type[AttentionBackend]
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    kind: ModelKind = "decoder"
    decoder_start_token_id: int | None = None  # encoder-decoder models
    max_encoder_len: int | None = None  # encoder-decoder models: the longest encoder input


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


AnyModelConfig = ModelConfig | BertConfig | BartConfig | DeepseekConfig | DeepseekV4Config
# (head size, window, chunk, learned sinks, attention type): what selection needs of a layer
AttentionKind = tuple[int, int | None, int | None, bool, AttentionType]


def attention_kinds(config: AnyModelConfig) -> list[AttentionKind]:
    """The distinct attention kinds of a model's layers (state layers select their own backend
    in `DecoderModel`)."""
    if isinstance(config, BertConfig):
        return [(config.head_size, None, None, False, AttentionType.ENCODER_ONLY)]
    if isinstance(config, DeepseekConfig):  # one latent per token (layer kind "mla")
        return [(config.latent_size, None, None, False, AttentionType.DECODER)]
    if isinstance(config, DeepseekV4Config):  # a sliding latent + compressed caches, sinks
        return [(config.head_dim, config.sliding_window, None, True, AttentionType.DECODER)]
    if isinstance(config, BartConfig):
        return [
            (config.encoder_head_size, None, None, False, AttentionType.ENCODER),
            (config.head_size, None, None, False, AttentionType.DECODER),
            (config.head_size, None, None, False, AttentionType.ENCODER_DECODER),
        ]
    attention = [k for k in config.layer_kinds if k.kind != "linear_state"] or [LayerKind.full()]
    return list(
        dict.fromkeys(
            (config.head_size, k.window, k.chunk, k.has_sinks, AttentionType.DECODER)
            for k in attention
        )
    )


def selector_configs(
    config: AnyModelConfig, dtype: torch.dtype, engine: Any
) -> list[SelectorConfig]:
    """One SelectorConfig per distinct attention kind of the model."""
    invariant = engine.batch_invariant
    return [
        SelectorConfig(
            head_size=head_size,
            dtype=dtype,
            block_size=engine.block_size,
            has_sinks=sinks,
            sliding_window=window,
            attention_chunk_size=chunk,
            attn_type=attn_type,
            device=engine.device,
            use_batch_invariant=invariant,
            layer_kind=layer_kind_of(config),
            kv_cache_dtype=engine.kv_cache_dtype,
            cache_users=CACHE_USER_ROLES if isinstance(config, DeepseekV4Config) else (),
        )
        for head_size, window, chunk, sinks, attn_type in attention_kinds(config)
    ]


def layer_kind_of(config: AnyModelConfig) -> str:
    """The `SelectorConfig.layer_kind` a model's attention layers need."""
    if isinstance(config, DeepseekConfig):
        return "mla"
    if isinstance(config, DeepseekV4Config):
        return "deepseek_v4"
    return "attention"


def backend_options(engine: Any, batch_invariant: bool) -> dict[str, Any]:
    """The keyword arguments every attention backend of the model gets from the engine's
    options (`EngineConfig`): batch-invariant mode, and an fp8 cache's torch dtype name."""
    options: dict[str, Any] = {"batch_invariant": True} if batch_invariant else {}
    if engine.kv_cache_dtype != "auto":
        options["kv_cache_dtype"] = kv_cache_dtype_name(engine.kv_cache_dtype)
    return options


def load_model(engine: Any) -> ModelSource:
    """`engine` is an `EngineConfig`."""
    device = torch.device(engine.device)
    dtype = as_dtype(engine.dtype) if engine.dtype else default_dtype(device)
    config = model_config(engine.model)
    max_model_len = resolve_max_model_len(engine.max_model_len, config)
    selector_cfgs = selector_configs(config, dtype, engine)
    backend_cls = select_backend(selector_cfgs, override=engine.backend)
    options = backend_options(engine, selector_cfgs[0].use_batch_invariant)
    if isinstance(config, (BertConfig, BartConfig)):
        encoder_model, encoder_tokenizer = _load_encoder_model(
            engine, config, backend_cls, dtype, device, options
        )
        return _encoder_source(encoder_model, encoder_tokenizer, backend_cls, config, max_model_len)
    if isinstance(config, DeepseekConfig | DeepseekV4Config):
        return _deepseek_source(engine, config, backend_cls, dtype, device, options, max_model_len)
    if engine.model in PRESETS:
        model = DecoderModel(
            config, backend_cls, dtype=dtype, device=device, backend_options=options
        )
        model.init_random_weights(engine.seed)
        tokenizer: Any = ByteTokenizer(config.bos_token_id, config.eos_token_ids[0])
    else:
        model, tokenizer = load_hf_model(
            checkpoint_path(engine.model), backend_cls, dtype=dtype, device=device,
            backend_options=options,
        )  # fmt: skip
    return ModelSource(
        model, tokenizer, backend_cls, config.vocab_size, max_model_len, config.eos_token_ids
    )


def _deepseek_source(
    engine: Any,
    config: DeepseekConfig | DeepseekV4Config,
    backend_cls: type[AttentionBackend],
    dtype: torch.dtype,
    device: torch.device,
    options: dict[str, Any],
    max_model_len: int,
) -> ModelSource:
    """A DeepSeek-V2/V3/V4 preset (random weights, byte tokenizer) or checkpoint."""
    v4 = isinstance(config, DeepseekV4Config)
    model: Any
    if engine.model in MLA_PRESETS or engine.model in V4_PRESETS:
        cls: Any = DeepseekV4ForCausalLM if v4 else DeepseekForCausalLM
        model = cls(config, backend_cls, dtype=dtype, device=device, backend_options=options)
        model.init_random_weights(engine.seed)
        tokenizer: Any = ByteTokenizer(config.bos_token_id, config.eos_token_ids[0])
    else:
        load = load_deepseek_v4 if v4 else load_deepseek
        path = checkpoint_path(engine.model)
        model, tokenizer = load(
            path, backend_cls, dtype=dtype, device=device, backend_options=options
        )
    return ModelSource(
        model, tokenizer, backend_cls, config.vocab_size, max_model_len, config.eos_token_ids
    )


def _load_encoder_model(
    engine: Any,
    config: BertConfig | BartConfig,
    backend_cls: type[AttentionBackend],
    dtype: torch.dtype,
    device: torch.device,
    options: dict[str, Any],
) -> tuple[Any, Any]:
    """A BERT (encoder-only) or BART (encoder-decoder) checkpoint and its tokenizer."""
    load = load_bert if isinstance(config, BertConfig) else load_bart
    path = checkpoint_path(engine.model)
    return load(path, backend_cls, dtype=dtype, device=device, backend_options=options)


def _encoder_source(
    model: Any,
    tokenizer: Any,
    backend_cls: type[AttentionBackend],
    config: BertConfig | BartConfig,
    max_model_len: int,
) -> ModelSource:
    common = (model, tokenizer, backend_cls, config.vocab_size, max_model_len)
    if isinstance(config, BertConfig):
        return ModelSource(*common, config.eos_token_ids, kind="encoder_only")
    return ModelSource(
        *common,
        config.eos_token_ids,
        kind="encoder_decoder",
        decoder_start_token_id=config.decoder_start_token_id,
        max_encoder_len=config.max_position_embeddings,
    )


def checkpoint_path(model: str) -> Path:
    return Path(os.path.expanduser(model))


def model_config(model: str) -> AnyModelConfig:
    """The config of a preset or of a Hugging Face checkpoint directory."""
    if model in PRESETS:
        return get_preset(model)
    if model in MLA_PRESETS:
        return MLA_PRESETS[model]
    if model in V4_PRESETS:
        return V4_PRESETS[model]
    path = checkpoint_path(model)
    if path.is_dir():
        hf = read_hf_config(path)
        if mla_version(hf) is not None:
            return deepseek_config_from_hf(hf, name=path.name)
        if is_deepseek_v4(hf):
            return deepseek_v4_config_from_hf(hf, name=path.name)
        family = encoder_family(hf)
        if family == "bert":
            return bert_config_from_hf(hf, name=path.name)
        if family == "bart":
            return bart_config_from_hf(hf, name=path.name)
        return config_from_hf(hf, name=path.name)
    raise ValueError(
        f"model {model!r} is neither a preset "
        f"({', '.join(sorted([*PRESETS, *MLA_PRESETS, *V4_PRESETS]))}) "
        "nor a checkpoint directory; see `unified-attn models`"
    )


def resolve_max_model_len(requested: Any, config: AnyModelConfig) -> int:
    """`requested`, checked against the model, or the model's max_position_embeddings."""
    limit = config.max_position_embeddings
    if requested is None:
        return limit
    if isinstance(requested, bool) or not isinstance(requested, int) or requested <= 0:
        raise ValueError(
            f"max_model_len must be a positive int, got {requested!r}; leave it unset for the "
            f"model's max_position_embeddings={limit}"
        )
    if requested > limit:
        raise ValueError(
            f"max_model_len={requested} exceeds the model's max_position_embeddings={limit}; "
            f"give at most {limit}"
        )
    return requested
