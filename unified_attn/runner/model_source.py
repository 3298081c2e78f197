"""Turn an engine's `model` argument (a preset name or a checkpoint path) into a model with its
backend selected, its weights and its tokenizer.

The backend is named as everywhere else (`selector.resolve_backend`) and selected for every
distinct attention kind of the model (`selector_configs`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs
import torch

from unified_attn.backend import AttentionBackend
from unified_attn.models import ByteTokenizer
from unified_attn.models.families import (
    ModelFamily,
    ModelKind,
    family_for_hf,
    family_of,
    family_of_preset,
    kv_cache_options,
    preset_names,
    shape_names,
)
from unified_attn.models.hf import read_hf_config
from unified_attn.selector import SelectorConfig, select_backend
from unified_attn.tensor_specs import as_dtype

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


AnyModelConfig = Any  # a config of a registered family (`models.families`)


def selector_configs(
    config: AnyModelConfig, dtype: torch.dtype, engine: Any
) -> list[SelectorConfig]:
    """One SelectorConfig per distinct attention kind of the model, with the engine's
    device, block size, KV-cache dtype and batch-invariant mode."""
    return family_of(config).selector_configs(
        config,
        dtype,
        device=engine.device,
        block_size=engine.block_size,
        kv_cache_dtype=engine.kv_cache_dtype,
        use_batch_invariant=engine.batch_invariant,
    )


def backend_options(engine: Any, batch_invariant: bool, config: AnyModelConfig) -> dict[str, Any]:
    """The keyword arguments the backends of the model of `config` get from the engine's
    options (`EngineConfig`): batch-invariant mode, an fp8 cache's torch dtype name, and for
    its state layers the cache mode and a slot per draft token (`ModelFamily.state_options`;
    the model hands those to its state backends only)."""
    options: dict[str, Any] = {"batch_invariant": True} if batch_invariant else {}
    options |= family_of(config).state_options(config, state_cache_mode(engine),
                                               state_slots_per_request(engine))  # fmt: skip
    return options | kv_cache_options(engine.kv_cache_dtype)


def state_cache_mode(engine: Any) -> str:
    """The state layers' cache mode an `EngineConfig` asks for (`mamba_cache_mode`; None:
    "none" with speculative decoding, whose drafts need a state slot each, else "align")."""
    if engine.mamba_cache_mode is not None:
        return str(engine.mamba_cache_mode)
    return "none" if engine.speculative_method is not None else "align"


def state_slots_per_request(engine: Any) -> int:
    """Draft tokens a state layer keeps a state slot for (0 without speculative decoding, and
    in a prefix-caching mode, which speculation refuses with its own message)."""
    if engine.speculative_method is None or state_cache_mode(engine) != "none":
        return 0
    return int(engine.num_speculative_tokens or 0)


def load_model(engine: Any) -> ModelSource:
    """`engine` is an `EngineConfig`."""
    device = torch.device(engine.device)
    dtype = as_dtype(engine.dtype) if engine.dtype else default_dtype(device)
    config = model_config(engine.model)
    max_model_len = resolve_max_model_len(engine.max_model_len, config)
    selector_cfgs = selector_configs(config, dtype, engine)
    backend_cls = select_backend(selector_cfgs, override=engine.backend)
    family = family_of(config)
    options = backend_options(engine, selector_cfgs[0].use_batch_invariant, config)
    if engine.model in family.presets:  # random weights, the byte tokenizer
        model = family.build(config, backend_cls, dtype=dtype, device=device,
                             backend_options=options)  # fmt: skip
        model.init_random_weights(engine.seed)
        tokenizer: Any = ByteTokenizer(config.bos_token_id, config.eos_token_ids[0])
    else:
        model, tokenizer = family.load(checkpoint_path(engine.model), backend_cls, dtype=dtype,
                                       device=device, backend_options=options)  # fmt: skip
    return ModelSource(
        model, tokenizer, backend_cls, config.vocab_size, max_model_len,
        tokenizer_eos_first(config.eos_token_ids, tokenizer),
        kind=family.model_kind,
        **family.source_fields(config),
    )  # fmt: skip


def tokenizer_eos_first(eos_token_ids: tuple[int, ...], tokenizer: Any) -> tuple[int, ...]:
    """The model's EOS ids with the tokenizer's own EOS first: vLLM's `eos_token_id` (a request
    it ends has no `stop_reason`); the others act as stop tokens."""
    eos = next(iter(getattr(tokenizer, "eos_token_ids", ())), None)
    if eos not in eos_token_ids:
        return eos_token_ids
    return (eos, *(t for t in eos_token_ids if t != eos))


def checkpoint_path(model: str) -> Path:
    return Path(os.path.expanduser(model))


def model_config(model: str) -> AnyModelConfig:
    """The config of a preset or of a Hugging Face checkpoint directory."""
    family = family_of_preset(model)
    if family is not None and model in family.presets:
        return family.presets[model]
    if not model.strip():
        raise ValueError(
            "model is empty; give a preset name (see `unified-attn models`) or a checkpoint "
            "directory"
        )
    path = checkpoint_path(model)
    if path.is_dir():
        hf = read_hf_config(path)
        return family_for_hf(hf).config_from_hf(hf, name=path.name)
    if model in shape_names():
        raise ValueError(
            f"model {model!r} is a real model's shape for `unified-attn plan` (no weights); run "
            f"a preset ({', '.join(preset_names())}) or a checkpoint directory"
        )
    raise ValueError(
        f"model {model!r} is neither a preset ({', '.join(preset_names())}) "
        "nor a checkpoint directory; see `unified-attn models`"
    )


def family_of_model(model: str) -> ModelFamily:
    """The family of an engine's `model` argument (a preset or a checkpoint directory)."""
    return family_of(model_config(model))


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
