"""Turn an engine's `model` argument (a preset name or a checkpoint path) into a model with its
backend selected, its weights and its tokenizer."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs
import torch

from unified_attn.backend import AttentionBackend
from unified_attn.models import (
    PRESETS,
    ByteTokenizer,
    DecoderModel,
    LayerKind,
    ModelConfig,
    get_preset,
)
from unified_attn.models.hf import config_from_hf, load_hf_model, read_hf_config
from unified_attn.selector import SelectorConfig, batch_invariant_from_env, select_backend
from unified_attn.tensor_specs import as_dtype


@attrs.frozen
class ModelSource:
    """A loaded model with what the engine needs to know about it."""

    model: DecoderModel
    tokenizer: Any
    backend_cls: type[AttentionBackend]
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def selector_configs(config: ModelConfig, dtype: torch.dtype, engine: Any) -> list[SelectorConfig]:
    """One SelectorConfig per distinct attention kind of the model (state layers select their
    own backend in `DecoderModel`)."""
    invariant = engine.batch_invariant or batch_invariant_from_env()
    attention = [k for k in config.layer_kinds if k.kind != "linear_state"] or [LayerKind.full()]
    kinds = dict.fromkeys((k.window, k.chunk, k.has_sinks) for k in attention)
    return [
        SelectorConfig(
            head_size=config.head_size,
            dtype=dtype,
            block_size=engine.block_size,
            has_sinks=sinks,
            sliding_window=window,
            attention_chunk_size=chunk,
            device=engine.device,
            use_batch_invariant=invariant,
        )
        for window, chunk, sinks in kinds
    ]


def load_model(engine: Any) -> ModelSource:
    """`engine` is an `EngineConfig`."""
    device = torch.device(engine.device)
    dtype = as_dtype(engine.dtype) if engine.dtype else default_dtype(device)
    path = Path(os.path.expanduser(engine.model))
    if engine.model in PRESETS:
        config = get_preset(engine.model)
    elif path.is_dir():
        config = config_from_hf(read_hf_config(path), name=path.name)
    else:
        raise ValueError(
            f"model {engine.model!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a "
            "checkpoint directory"
        )
    selector_cfgs = selector_configs(config, dtype, engine)
    backend_cls = select_backend(selector_cfgs, override=engine.backend)
    options = {"batch_invariant": True} if selector_cfgs[0].use_batch_invariant else {}
    if engine.model in PRESETS:
        model = DecoderModel(
            config, backend_cls, dtype=dtype, device=device, backend_options=options
        )
        model.init_random_weights(engine.seed)
        tokenizer: Any = ByteTokenizer(config.bos_token_id, config.eos_token_ids[0])
    else:
        model, tokenizer = load_hf_model(
            path, backend_cls, dtype=dtype, device=device, backend_options=options
        )
    max_model_len = engine.max_model_len or config.max_position_embeddings
    if max_model_len > config.max_position_embeddings:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
            f"{config.max_position_embeddings}"
        )
    return ModelSource(
        model, tokenizer, backend_cls, config.vocab_size, max_model_len, config.eos_token_ids
    )
