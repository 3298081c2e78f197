"""Load Llama, Qwen2 and Mistral checkpoints saved in Hugging Face layout.

Sliding-window convention. transformers' `sliding_window_overlay(W)` (masking_utils.py, used by
the eager and sdpa masks of Mistral and Qwen2) keeps key `kv_idx` for query `q_idx` when
`kv_idx > q_idx - W`, on top of the causal `kv_idx <= q_idx`: a query at position p sees keys
`[p - W + 1, p]`, W keys including itself. Its flash-attention path passes
`window_size=(W - 1, W - 1)`, the same set. That is exactly `LayerConfig.sliding_window = W`, so
`config.json`'s `sliding_window` is used unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from unified_attn.backend import AttentionBackend
from unified_attn.models.config import LayerKind, ModelConfig, RopeScaling
from unified_attn.models.decoder import DecoderModel
from unified_attn.models.tokenizer import HFTokenizer, load_tokenizer

HFConfig = dict[str, Any]


def load_hf_model(
    path: str | Path,
    backend_cls: type[AttentionBackend],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    backend_options: dict[str, Any] | None = None,
) -> tuple[DecoderModel, HFTokenizer | None]:
    """Model (weights loaded, cast to `dtype`) and the checkpoint's tokenizer, if it ships one."""
    path = Path(path)
    config = config_from_hf(read_hf_config(path), name=path.name)
    model = DecoderModel(
        config, backend_cls, dtype=dtype, device=device, backend_options=backend_options
    )
    load_weights(model, read_state_dict(path), source=str(path))
    return model, load_tokenizer(path)


def read_hf_config(path: Path) -> HFConfig:
    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{path} has no config.json; expected a Hugging Face checkpoint")
    return json.loads(file.read_text())


# ---- config.json -> ModelConfig ----------------------------------------------------------------


def _llama(hf: HFConfig) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    return dict(
        attention_bias=bias,
        attention_output_bias=bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        layer_kinds=[LayerKind.full()] * hf["num_hidden_layers"],
    )


def _qwen2(hf: HFConfig) -> dict[str, Any]:
    return dict(attention_bias=True, layer_kinds=_qwen2_layer_kinds(hf))


def _qwen2_layer_kinds(hf: HFConfig) -> list[LayerKind]:
    # As Qwen2Config: the window only counts with use_sliding_window; then `layer_types` if given,
    # else layers >= max_window_layers slide.
    num_layers, window = hf["num_hidden_layers"], hf.get("sliding_window")
    if not hf.get("use_sliding_window", False) or window is None:
        return [LayerKind.full()] * num_layers
    first = hf.get("max_window_layers", 28)
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
    ]
    by_type = {"full_attention": LayerKind.full(), "sliding_attention": LayerKind.sliding(window)}
    unknown = set(types) - set(by_type)
    if unknown:
        raise ValueError(f"Qwen2 layer_types {sorted(unknown)} are not supported")
    return [by_type[t] for t in types]


def _mistral(hf: HFConfig) -> dict[str, Any]:
    window = hf.get("sliding_window")
    kind = LayerKind.full() if window is None else LayerKind.sliding(window)
    return dict(layer_kinds=[kind] * hf["num_hidden_layers"])


ARCHITECTURES: dict[str, Callable[[HFConfig], dict[str, Any]]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
}


def config_from_hf(hf: HFConfig, name: str = "hf") -> ModelConfig:
    arch = _architecture(hf)
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{arch}: hidden_act={hf['hidden_act']!r} is not supported, only 'silu'")
    num_heads = hf["num_attention_heads"]
    theta, scaling = _rope(hf)
    return ModelConfig(
        name=name,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_size=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
        **ARCHITECTURES[arch](hf),
    )


def _architecture(hf: HFConfig) -> str:
    archs = hf.get("architectures") or [None]
    if archs[0] not in ARCHITECTURES:
        raise ValueError(
            f"architecture {archs[0]!r} is not supported; supported architectures: "
            f"{', '.join(ARCHITECTURES)}"
        )
    return str(archs[0])


def _rope(hf: HFConfig) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from transformers 5 `rope_parameters` or 4.x `rope_theta`/`rope_scaling`."""
    params: dict[str, Any] = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta") or hf.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling(rope_type="linear", factor=params["factor"])
    if rope_type == "llama3":
        original = params.get("original_max_position_embeddings")
        return theta, RopeScaling(
            factor=params["factor"],
            low_freq_factor=params["low_freq_factor"],
            high_freq_factor=params["high_freq_factor"],
            original_max_position_embeddings=original or hf["max_position_embeddings"],
        )
    raise ValueError(f"RoPE type {rope_type!r} is not supported; use default, linear or llama3")


# ---- weights ------------------------------------------------------------------------------------


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of `model.safetensors` or of the shards named by its index, on CPU."""
    from safetensors.torch import load_file  # optional dependency: pip install .[hf]

    index = path / "model.safetensors.index.json"
    if (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    elif index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        raise FileNotFoundError(
            f"{path} has neither model.safetensors nor model.safetensors.index.json; only "
            "safetensors checkpoints are supported (re-save with save_pretrained)"
        )
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(path / file))
    return state


def load_weights(model: DecoderModel, state: dict[str, torch.Tensor], source: str) -> None:
    """Copy `state` into `model` (casting dtype); every weight must be present and expected."""
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # some tied checkpoints store the copy anyway
    expected = model.state_dict()
    missing, unexpected = expected.keys() - state.keys(), state.keys() - expected.keys()
    if missing or unexpected:
        raise ValueError(
            f"weights of {source} do not match the model config: missing {_few(missing)}, "
            f"unexpected {_few(unexpected)}; check config.json against the checkpoint"
        )
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"weight {name} of {source} has shape {tuple(tensor.shape)}, the config implies "
                f"{tuple(expected[name].shape)}"
            )
    model.load_state_dict(state)


def _few(names: set[str], limit: int = 8) -> str:
    shown = sorted(names)[:limit]
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{shown}{more}" if names else "none"
