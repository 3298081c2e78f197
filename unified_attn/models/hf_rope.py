"""RoPE settings of a Hugging Face `config.json` (transformers 5's `rope_parameters` or 4.x's
`rope_scaling` + `rope_theta`) as `(theta, RopeScaling)`."""

from __future__ import annotations

from typing import Any

from unified_attn.models.config import RopeScaling

HFConfig = dict[str, Any]


def flat_rope_params(hf: HFConfig) -> dict[str, Any]:
    """transformers 5 `rope_parameters` or 4.x `rope_scaling` (one set for every layer)."""
    return dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})


def rope_fields(hf: HFConfig) -> dict[str, Any]:
    theta, scaling = rope(hf, flat_rope_params(hf), hf.get("rope_theta") or 10000.0)
    return dict(rope_theta=theta, rope_scaling=scaling)


def rope(
    hf: HFConfig, params: dict[str, Any], default_theta: float
) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) of one set of RoPE parameters; `default_theta` when it has no theta."""
    theta = float(params.get("rope_theta") or default_theta)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"partial rotary embeddings (partial_rotary_factor="
            f"{params['partial_rotary_factor']}) are not supported; only 1.0"
        )
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
        return theta, yarn(hf, params)
    raise ValueError(
        f"RoPE type {rope_type!r} is not supported; use default, linear, llama3 or yarn"
    )


def yarn(hf: HFConfig, params: dict[str, Any]) -> RopeScaling:
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
