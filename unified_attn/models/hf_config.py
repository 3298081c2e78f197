"""Translate a Hugging Face `config.json` into a `ModelConfig`, one function per architecture.

Sliding-window convention. transformers' `sliding_window_overlay(W)` (masking_utils.py, used by
the eager and sdpa masks of Mistral, Qwen2, Gemma 2 and GPT-OSS) keeps key `kv_idx` for query
`q_idx` when `kv_idx > q_idx - W`, on top of the causal `kv_idx <= q_idx`: a query at position p
sees keys `[p - W + 1, p]`, W keys including itself. Its flash-attention path passes
`window_size=(W - 1, W - 1)`, the same set. That is exactly `LayerConfig.sliding_window = W`, so
`config.json`'s `sliding_window` is used unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unified_attn.models.config import LayerKind, ModelConfig, MoEConfig, RopeScaling

HFConfig = dict[str, Any]


def read_hf_config(path: Path) -> HFConfig:
    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{path} has no config.json; expected a Hugging Face checkpoint")
    return json.loads(file.read_text())


def _llama(hf: HFConfig) -> dict[str, Any]:
    _check_activation(hf, "hidden_act", "silu")
    bias = bool(hf.get("attention_bias", False))
    return dict(
        attention_bias=bias,
        attention_output_bias=bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        layer_kinds=[LayerKind.full()] * hf["num_hidden_layers"],
    )


def _qwen2(hf: HFConfig) -> dict[str, Any]:
    _check_activation(hf, "hidden_act", "silu")
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
    return _kinds_of_types(hf, types, window)


def _mistral(hf: HFConfig) -> dict[str, Any]:
    _check_activation(hf, "hidden_act", "silu")
    window = hf.get("sliding_window")
    kind = LayerKind.full() if window is None else LayerKind.sliding(window)
    return dict(layer_kinds=[kind] * hf["num_hidden_layers"])


def _gemma2(hf: HFConfig) -> dict[str, Any]:
    _check_activation(hf, "hidden_activation", "gelu_pytorch_tanh")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("Gemma2ForCausalLM: use_bidirectional_attention is not supported")
    bias = bool(hf.get("attention_bias", False))
    return dict(
        attention_bias=bias,
        attention_output_bias=bias,
        mlp_kind="geglu",
        norm_style="gemma",
        post_norms=True,
        embed_scale=hf["hidden_size"] ** 0.5,
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
        attn_logit_softcap=hf.get("attn_logit_softcapping"),
        final_logit_softcap=hf.get("final_logit_softcapping"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        layer_kinds=_kinds_of_types(hf, _alternating_types(hf), hf.get("sliding_window")),
    )


def _gpt_oss(hf: HFConfig) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", True))
    moe = MoEConfig(
        num_experts=hf.get("num_local_experts") or hf["num_experts"],
        top_k=hf.get("num_experts_per_tok", 4),
        swiglu_alpha=hf.get("swiglu_alpha", 1.702),
        swiglu_limit=hf.get("swiglu_limit", 7.0),
    )
    types, window = _alternating_types(hf), hf.get("sliding_window", 128)
    return dict(
        attention_bias=bias,
        attention_output_bias=bias,
        mlp_kind="moe",
        moe=moe,
        norm_style="float32",
        layer_kinds=_kinds_of_types(hf, types, window, has_sinks=True),
    )


def _alternating_types(hf: HFConfig) -> list[str]:
    """`layer_types`, or Gemma 2's and GPT-OSS's default: even layers slide, odd ones are full."""
    return hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention"
        for i in range(hf["num_hidden_layers"])
    ]


def _kinds_of_types(
    hf: HFConfig, types: list[str], window: int | None, *, has_sinks: bool = False
) -> list[LayerKind]:
    full = LayerKind.full(has_sinks=has_sinks)
    sliding = full if window is None else LayerKind.sliding(window, has_sinks=has_sinks)
    by_type = {"full_attention": full, "sliding_attention": sliding}
    unknown = set(types) - set(by_type)
    if unknown:
        raise ValueError(
            f"{_architecture(hf)}: layer_types {sorted(unknown)} are not supported; supported: "
            f"{sorted(by_type)}"
        )
    return [by_type[t] for t in types]


def _check_activation(hf: HFConfig, key: str, supported: str) -> None:
    act = hf.get(key) or supported
    if act != supported:
        raise ValueError(f"{_architecture(hf)}: {key}={act!r} is not supported, only {supported!r}")


ARCHITECTURES: dict[str, Callable[[HFConfig], dict[str, Any]]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "Gemma2ForCausalLM": _gemma2,
    "GptOssForCausalLM": _gpt_oss,
}


def config_from_hf(hf: HFConfig, name: str = "hf") -> ModelConfig:
    """A `ModelConfig` from `config.json`: shared fields, then the architecture's own."""
    arch = _architecture(hf)
    quantization = hf.get("quantization_config")
    if quantization:
        raise ValueError(
            f"{arch}: quantized checkpoints (quant_method="
            f"{quantization.get('quant_method')!r}) are not supported; dequantize first, e.g. "
            "load with transformers in bfloat16 and save_pretrained"
        )
    return ModelConfig(**{**_common_fields(hf, name), **ARCHITECTURES[arch](hf)})


def _common_fields(hf: HFConfig, name: str) -> dict[str, Any]:
    num_heads = hf["num_attention_heads"]
    theta, scaling = _rope(hf)
    return dict(
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
    if rope_type == "yarn":
        return theta, _yarn(hf, params)
    raise ValueError(
        f"RoPE type {rope_type!r} is not supported; use default, linear, llama3 or yarn"
    )


def _yarn(hf: HFConfig, params: dict[str, Any]) -> RopeScaling:
    # As transformers: a top-level original_max_position_embeddings wins; a missing factor is
    # max_position_embeddings / original; a missing `truncate` means True.
    original = (
        hf.get("original_max_position_embeddings")
        or params.get("original_max_position_embeddings")
        or hf["max_position_embeddings"]
    )
    return RopeScaling(
        rope_type="yarn",
        factor=params.get("factor") or hf["max_position_embeddings"] / original,
        original_max_position_embeddings=original,
        beta_fast=params.get("beta_fast") or 32.0,
        beta_slow=params.get("beta_slow") or 1.0,
        truncate=bool(params.get("truncate", True)),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
    )
