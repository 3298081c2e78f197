"""Load BERT and BART checkpoints saved in Hugging Face layout: `config.json` into a
`BertConfig` / `BartConfig`, `model.safetensors` (or its shards) as a checked state dict.

BERT: weights of `BertModel` (`embeddings.*`, `encoder.layer.N.*`) or of a `Bert*For*` task
model (the same under `bert.`); the pooler and task heads are dropped (the model returns the
last hidden states). BART: weights of `BartForConditionalGeneration` (`model.*`,
`final_logits_bias`) or of `BartModel` (no `model.` prefix, no bias: it is 0); the copies of
`model.shared.weight` (`lm_head.weight`, the encoder's and decoder's `embed_tokens.weight`) are
dropped. Every problem is a `ValueError` naming the checkpoint, what was expected, what was
found and what to do; names and shapes are checked on a meta-device model first.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch

from unified_attn.backend import AttentionBackend
from unified_attn.models.bart import BartConfig, EncoderDecoderModel
from unified_attn.models.bert import BertConfig, BertEncoderModel
from unified_attn.models.hf_checkpoint import CheckpointFormat
from unified_attn.models.hf_config import HFConfig
from unified_attn.models.tokenizer import HFTokenizer

__all__ = ["bart_config_from_hf", "bert_config_from_hf", "load_bart", "load_bert"]

# ---- config.json --------------------------------------------------------------------------------

# (config.json field, the value that is refused, what that value means)
BERT_UNSUPPORTED = (
    ("is_decoder", True, "a causal decoder"),
    ("add_cross_attention", True, "cross-attention layers"),
)
BART_UNSUPPORTED = (
    ("normalize_before", True, "pre-LN layers, mBART style"),
    ("add_final_layer_norm", True, "a final LayerNorm after the layers, mBART style"),
    ("static_position_embeddings", True, "sinusoidal positions"),
    ("tie_word_embeddings", False, "an LM head apart from model.shared"),
)


def bert_config_from_hf(hf: HFConfig, name: str) -> BertConfig:
    """A `BertConfig` from BERT's `config.json` (absolute positions, encoder only)."""
    _check_model_type(hf, "bert", name)
    _refuse_unsupported(hf, name, BERT_UNSUPPORTED, "a bidirectional encoder")
    kind = hf.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(
            f"checkpoint {name}: config.json sets position_embedding_type={kind!r}, which is "
            "not supported; only 'absolute' (learned absolute position embeddings) loads"
        )
    return _build(
        BertConfig,
        name,
        lambda: dict(
            name=name,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"],
            max_position_embeddings=hf.get("max_position_embeddings", 512),
            type_vocab_size=hf.get("type_vocab_size", 2),
            layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
            hidden_act=hf.get("hidden_act", "gelu"),
            pad_token_id=hf.get("pad_token_id", 0),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_token_ids(hf.get("eos_token_id")),
        ),
    )


def bart_config_from_hf(hf: HFConfig, name: str) -> BartConfig:
    """A `BartConfig` from BART's `config.json` (post-LN, learned positions, tied LM head)."""
    _check_model_type(hf, "bart", name)
    _refuse_unsupported(
        hf, name, BART_UNSUPPORTED, "BART itself (post-LN, learned positions, tied LM head)"
    )
    eos = _token_ids(hf.get("eos_token_id", 2))
    return _build(
        BartConfig,
        name,
        lambda: dict(
            name=name,
            vocab_size=hf["vocab_size"],
            d_model=hf["d_model"],
            encoder_layers=hf["encoder_layers"],
            decoder_layers=hf["decoder_layers"],
            encoder_attention_heads=hf["encoder_attention_heads"],
            decoder_attention_heads=hf["decoder_attention_heads"],
            encoder_ffn_dim=hf["encoder_ffn_dim"],
            decoder_ffn_dim=hf["decoder_ffn_dim"],
            max_position_embeddings=hf.get("max_position_embeddings", 1024),
            activation_function=hf.get("activation_function", "gelu"),
            scale_embedding=bool(hf.get("scale_embedding", False)),
            pad_token_id=hf.get("pad_token_id", 1),
            bos_token_id=hf.get("bos_token_id", 0),
            eos_token_id=eos[0] if eos else None,
            eos_token_ids=eos,
            decoder_start_token_id=hf.get("decoder_start_token_id", 2),
            forced_bos_token_id=hf.get("forced_bos_token_id"),
        ),
    )


def _check_model_type(hf: HFConfig, expected: str, name: str) -> None:
    found = hf.get("model_type", expected)
    if found != expected:
        raise ValueError(
            f"checkpoint {name}: config.json has model_type={found!r}, expected {expected!r}; "
            "load it with the loader of its own family"
        )


def _refuse_unsupported(
    hf: HFConfig, name: str, unsupported: tuple[tuple[str, Any, str], ...], supported: str
) -> None:
    for field, value, what in unsupported:
        if field in hf and hf[field] == value:
            raise ValueError(
                f"checkpoint {name}: config.json sets {field}={hf[field]!r} ({what}), which is "
                f"not supported; only {supported} loads"
            )


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


ConfigT = TypeVar("ConfigT", BertConfig, BartConfig)


def _build(cls: type[ConfigT], name: str, fields: Callable[[], dict[str, Any]]) -> ConfigT:
    try:
        values = fields()
    except KeyError as error:
        raise ValueError(
            f"checkpoint {name}: config.json has no {error.args[0]!r}, which {cls.__name__} "
            "needs; re-save the config with transformers' save_pretrained"
        ) from None
    return cls(**values)


# ---- loading ------------------------------------------------------------------------------------


def load_bert(
    path: str | Path,
    backend_cls: type[AttentionBackend],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    backend_options: dict[str, Any] | None = None,
) -> tuple[BertEncoderModel, HFTokenizer | None]:
    """BERT encoder (weights loaded, cast to `dtype`) and the checkpoint's tokenizer, if any."""
    return _BERT.load(
        path, backend_cls, dtype=dtype, device=device, backend_options=backend_options
    )


def load_bart(
    path: str | Path,
    backend_cls: type[AttentionBackend],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    backend_options: dict[str, Any] | None = None,
) -> tuple[EncoderDecoderModel, HFTokenizer | None]:
    """BART (weights loaded, cast to `dtype`) and the checkpoint's tokenizer, if any."""
    return _BART.load(
        path, backend_cls, dtype=dtype, device=device, backend_options=backend_options
    )


def _bert_names(raw: dict[str, torch.Tensor], config: BertConfig) -> dict[str, torch.Tensor]:
    """`BertModel` names: `bert.` dropped (with the task heads outside it), no pooler (the
    names do not depend on `config`)."""
    if any(name.startswith("bert.") for name in raw):
        raw = {name[5:]: t for name, t in raw.items() if name.startswith("bert.")}
    ignored = ("pooler.", "embeddings.position_ids", "embeddings.token_type_ids")
    return {name: t for name, t in raw.items() if not name.startswith(ignored)}


SHARED = "model.shared.weight"
SHARED_COPIES = (
    "lm_head.weight",
    "model.encoder.embed_tokens.weight",
    "model.decoder.embed_tokens.weight",
)


def _bart_names(raw: dict[str, torch.Tensor], config: BartConfig) -> dict[str, torch.Tensor]:
    """`BartForConditionalGeneration` names without the copies of `model.shared.weight`; a
    `BartModel` checkpoint gains the `model.` prefix and a zero `final_logits_bias`."""
    if not any(name.startswith("model.") for name in raw):
        raw = {(n if n == "final_logits_bias" else f"model.{n}"): t for n, t in raw.items()}
    state = {n: t for n, t in raw.items() if not n.endswith(".version")}
    copies = [state.pop(name) for name in SHARED_COPIES if name in state]
    if SHARED not in state and copies:  # some savers keep a copy instead of the original
        state[SHARED] = copies[0]
    state.setdefault("final_logits_bias", torch.zeros(1, config.vocab_size))
    return state


def _check(
    state: dict[str, torch.Tensor], expected_state: dict[str, torch.Tensor], source: str, arch: str
) -> None:
    """A `ValueError` unless `state` has the names and shapes of `expected_state` (a meta
    model's)."""
    expected = {n: tuple(t.shape) for n, t in expected_state.items()}
    missing, unexpected = expected.keys() - state.keys(), state.keys() - expected.keys()
    if unexpected:
        raise ValueError(
            f"checkpoint {source}: weights {_few(unexpected)} have no place in a {arch} "
            f"(expected names like {sorted(expected)[0]!r}; missing {_few(missing)}); "
            f"load a {arch} checkpoint or re-save this one from {arch}"
        )
    if missing:
        raise ValueError(
            f"checkpoint {source}: weights {_few(missing)} are missing, which the config "
            "implies; check config.json (layers, sizes) against the checkpoint"
        )
    for name in sorted(expected):
        if tuple(state[name].shape) != expected[name]:
            raise ValueError(
                f"checkpoint {source}: weight {name} has shape {tuple(state[name].shape)}, the "
                f"config implies {expected[name]}; check config.json's sizes against the "
                "checkpoint"
            )


def _few(names: set[str], limit: int = 8) -> str:
    shown = sorted(names)[:limit]
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{shown}{more}" if names else "none"


_BERT = CheckpointFormat(
    model_cls=BertEncoderModel,
    read_config=bert_config_from_hf,
    model_names=_bert_names,
    check=partial(_check, arch="BertModel"),
)
_BART = CheckpointFormat(
    model_cls=EncoderDecoderModel,
    read_config=bart_config_from_hf,
    model_names=_bart_names,
    check=partial(_check, arch="BartForConditionalGeneration"),
)
