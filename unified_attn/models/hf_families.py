"""One function per supported architecture: the `ModelConfig` fields its `config.json` sets
beyond the shared ones, the RoPE readers of architectures with their own RoPE fields, the
`model_type` names and the checkpoint weight renames (see `hf_config` for the conventions)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unified_attn.models.config import LayerKind, MoEConfig
from unified_attn.models.gated_delta_config import GatedDeltaConfig
from unified_attn.models.hf_llama4 import llama4_expert_weights, llama4_fields, llama4_rope
from unified_attn.models.hf_rope import flat_rope_params, rope, rope_fields

HFConfig = dict[str, Any]


def _arch(hf: HFConfig) -> str:
    """The architecture `config.json` names (for messages; `hf_config` checked it first)."""
    return str((hf.get("architectures") or [hf.get("model_type", "config.json")])[0])


def _projection_bias(hf: HFConfig, default: bool = False) -> dict[str, bool]:
    """`attention_bias` as Llama, Qwen3, Gemma and GPT-OSS read it: biases on q/k/v and o_proj,
    or on none of them."""
    bias = bool(hf.get("attention_bias", default))
    return dict(attention_bias=bias, attention_output_bias=bias)


def _llama(hf: HFConfig) -> dict[str, Any]:
    _check_activation(hf, "hidden_act", "silu")
    return dict(
        **_projection_bias(hf),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        layer_kinds=[LayerKind.full()] * hf["num_hidden_layers"],
    )


def _qwen2(hf: HFConfig) -> dict[str, Any]:
    _check_activation(hf, "hidden_act", "silu")
    return dict(attention_bias=True, layer_kinds=_qwen2_layer_kinds(hf))


def _qwen3(hf: HFConfig) -> dict[str, Any]:
    """Qwen2 with an RMSNorm over each q and k head, and biases on all four projections or none."""
    _check_activation(hf, "hidden_act", "silu")
    return dict(
        **_projection_bias(hf),
        qk_norm=True,
        layer_kinds=_qwen2_layer_kinds(hf),
    )


def _qwen2_layer_kinds(hf: HFConfig) -> list[LayerKind]:
    # As Qwen2Config and Qwen3Config: layers >= max_window_layers slide.
    first = hf.get("max_window_layers", 28)
    return _qwen_window_kinds(hf, lambda i: i >= first)


def _qwen_window_kinds(hf: HFConfig, slides: Callable[[int], bool]) -> list[LayerKind]:
    """The Qwen families' windows: they only count with `use_sliding_window`; then
    `layer_types` if given, else the layers `slides(i)` picks."""
    num_layers, window = hf["num_hidden_layers"], hf.get("sliding_window")
    if not hf.get("use_sliding_window", False) or not window:
        return [LayerKind.full()] * num_layers
    types = hf.get("layer_types") or [
        "sliding_attention" if slides(i) else "full_attention" for i in range(num_layers)
    ]
    return _kinds_of_types(hf, types, window)


def _mistral(hf: HFConfig) -> dict[str, Any]:
    _check_activation(hf, "hidden_act", "silu")
    return dict(layer_kinds=_uniform_window_kinds(hf))


def _phi3(hf: HFConfig) -> dict[str, Any]:
    """Mistral-like (an optional window on every layer) with fused qkv and gate-up projections."""
    _check_activation(hf, "hidden_act", "silu")
    return dict(fused_qkv=True, fused_gate_up=True, layer_kinds=_uniform_window_kinds(hf))


def _phi3_rope(hf: HFConfig) -> dict[str, Any]:
    # Phi3Config renames the rope types "su" and "yarn" of older configs to "longrope".
    params = flat_rope_params(hf)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ("su", "yarn", "longrope"):
        raise ValueError(
            f"Phi3ForCausalLM: RoPE type {rope_type!r} (LongRoPE, the 128k-context Phi-3 "
            "models) is not supported; use a Phi-3 checkpoint with default RoPE (the 4k ones)"
        )
    return rope_fields(hf)


def _uniform_window_kinds(hf: HFConfig) -> list[LayerKind]:
    window = hf.get("sliding_window")
    kind = LayerKind.full() if window is None else LayerKind.sliding(window)
    return [kind] * hf["num_hidden_layers"]


def _gemma_common(hf: HFConfig) -> dict[str, Any]:
    """What Gemma 2 and Gemma 3 share: GeGLU, Gemma norms before and after both blocks, the
    scaled embedding, the query scalar, soft caps, tied embeddings."""
    arch = _arch(hf)
    _check_activation(hf, "hidden_activation", "gelu_pytorch_tanh")
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"{arch}: use_bidirectional_attention is not supported")
    return dict(
        **_projection_bias(hf),
        mlp_kind="geglu",
        norm_style="gemma",
        post_norms=True,
        embed_scale=hf["hidden_size"] ** 0.5,
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
        attn_logit_softcap=hf.get("attn_logit_softcapping"),
        final_logit_softcap=hf.get("final_logit_softcapping"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def _gemma2(hf: HFConfig) -> dict[str, Any]:
    window = hf.get("sliding_window")
    return dict(
        **_gemma_common(hf),
        layer_kinds=_kinds_of_types(hf, _alternating_types(hf), window),
    )


def _gemma3(hf: HFConfig) -> dict[str, Any]:
    """Gemma 2 plus q/k norms, its own layer pattern (5 local layers per global one unless
    `layer_types` says otherwise) and per-kind RoPE: local layers use `rope_local_base_freq`
    (4.x configs) or `rope_parameters["sliding_attention"]` (5.x), global ones the global
    theta and scaling."""
    num_layers, window = hf["num_hidden_layers"], hf.get("sliding_window", 4096)
    pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
    ]
    if window is None and "sliding_attention" in types:
        raise ValueError(
            "Gemma3ForCausalLM: sliding_window is null but layer_types has sliding_attention "
            "layers; give the window (transformers' default is 4096)"
        )
    return dict(
        **_gemma_common(hf),
        qk_norm=True,
        layer_kinds=_kinds_of_types(hf, types, window),
    )


def _gemma3_rope(hf: HFConfig) -> dict[str, Any]:
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # transformers 5: per kind
        global_params = params.get("full_attention") or {}
        local_params = params.get("sliding_attention") or {}
    else:  # transformers 4: rope_theta + rope_scaling global, rope_local_base_freq local
        global_params, local_params = params or hf.get("rope_scaling") or {}, {}
    theta, scaling = rope(hf, global_params, hf.get("rope_theta") or 1_000_000.0)
    local_theta, local_scaling = rope(hf, local_params, hf.get("rope_local_base_freq") or 10_000.0)
    return dict(
        rope_theta=theta,
        rope_scaling=scaling,
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
    )


def _gpt_oss(hf: HFConfig) -> dict[str, Any]:
    moe = MoEConfig(
        num_experts=hf.get("num_local_experts") or hf["num_experts"],
        top_k=hf.get("num_experts_per_tok", 4),
        swiglu_alpha=hf.get("swiglu_alpha", 1.702),
        swiglu_limit=hf.get("swiglu_limit", 7.0),
    )
    types, window = _alternating_types(hf), hf.get("sliding_window", 128)
    return dict(
        **_projection_bias(hf, default=True),
        mlp_kind="moe",
        moe=moe,
        norm_style="float32",
        layer_kinds=_kinds_of_types(hf, types, window, has_sinks=True),
    )


def _mixtral(hf: HFConfig) -> dict[str, Any]:
    """Mistral attention; every MLP a sparse MoE of SwiGLU experts, softmax over all experts,
    top-k renormalised (weights renamed on load, see WEIGHT_RENAMES)."""
    _check_activation(hf, "hidden_act", "silu")
    moe = MoEConfig(
        num_experts=hf.get("num_local_experts", 8),
        top_k=hf.get("num_experts_per_tok", 2),
        expert_kind="swiglu",
        router_softmax="all",
        norm_topk_prob=True,
    )
    return dict(mlp_kind="moe", moe=moe, layer_kinds=_uniform_window_kinds(hf))


def _qwen2_moe(hf: HFConfig) -> dict[str, Any]:
    """Qwen2 attention; sparse MoE with a sigmoid-gated shared expert, except on the layers
    `mlp_only_layers` names and those `decoder_sparse_step` skips (dense SwiGLU there)."""
    _check_activation(hf, "hidden_act", "silu")
    fields: dict[str, Any] = dict(
        attention_bias=bool(hf.get("qkv_bias", True)), layer_kinds=_qwen2_moe_layer_kinds(hf)
    )
    shared = hf.get("shared_expert_intermediate_size", 5632)
    return fields | _qwen_moe(hf, dict(num_experts=60, num_experts_per_tok=4,
                                       moe_intermediate_size=1408), shared)  # fmt: skip


def _qwen3_moe(hf: HFConfig) -> dict[str, Any]:
    """Qwen3 attention (q/k norms; with `use_sliding_window`, a window on every layer) and
    Qwen2-MoE's experts without the shared expert (Qwen3-30B-A3B, Qwen3-235B-A22B)."""
    _check_activation(hf, "hidden_act", "silu")
    fields: dict[str, Any] = dict(
        **_projection_bias(hf), qk_norm=True, layer_kinds=_qwen_window_kinds(hf, lambda i: True)
    )
    return fields | _qwen_moe(hf, dict(num_experts=128, num_experts_per_tok=8,
                                       moe_intermediate_size=768), None)  # fmt: skip


def _qwen_moe(
    hf: HFConfig, defaults: dict[str, int], shared: int | None, norm_topk: bool = False
) -> dict[str, Any]:
    """The Qwen MoE MLPs (transformers' defaults where the config is silent): softmax over all
    experts, the top k (renormalised with `norm_topk_prob`) in the model dtype, dense on the
    layers `mlp_only_layers` names and those `decoder_sparse_step` skips; `shared`: the width
    of the sigmoid-gated shared expert (None: none)."""
    config = defaults | {k: hf[k] for k in defaults if hf.get(k) is not None}
    if hf.get("num_experts") is None and hf.get("num_local_experts") is not None:
        config["num_experts"] = hf["num_local_experts"]  # transformers 5's name for it
    if not config["num_experts"]:  # transformers: every layer dense
        return {}
    step, only = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    moe = MoEConfig(
        num_experts=config["num_experts"],
        top_k=config["num_experts_per_tok"],
        expert_kind="swiglu",
        router_softmax="all",
        norm_topk_prob=bool(hf.get("norm_topk_prob", norm_topk)),
        routing_weights_dtype="model",
        intermediate_size=config["moe_intermediate_size"],
        shared_expert_intermediate_size=shared,
    )
    dense = [i for i in range(hf["num_hidden_layers"]) if i in only or (i + 1) % step]
    return dict(mlp_kind="moe", moe=moe, dense_mlp_layers=dense)


def _qwen3_next(hf: HFConfig) -> dict[str, Any]:
    """Gated delta-net layers and gated attention layers (`full_attention_interval` apart),
    Gemma-style norms, a sparse MoE with a shared expert (Qwen3-Next-80B-A3B's defaults)."""
    _check_activation(hf, "hidden_act", "silu")
    num_layers, every = hf["num_hidden_layers"], hf.get("full_attention_interval", 4)
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(num_layers)
    ]
    by_type = {"full_attention": LayerKind.full(), "linear_attention": LayerKind.gated_delta()}
    if set(types) - set(by_type) or len(types) != num_layers:
        raise ValueError(f"{_arch(hf)}: layer_types must be {num_layers} of {sorted(by_type)}, "
                         f"got {types}")  # fmt: skip
    delta = GatedDeltaConfig(
        num_k_heads=hf.get("linear_num_key_heads", 16),
        num_v_heads=hf.get("linear_num_value_heads", 32),
        k_head_size=hf.get("linear_key_head_dim", 128),
        v_head_size=hf.get("linear_value_head_dim", 128),
        conv_kernel=hf.get("linear_conv_kernel_dim", 4),
    )
    fields = dict(**_projection_bias(hf), qk_norm=True, norm_style="gemma", attn_output_gate=True,
                  gated_delta=delta, layer_kinds=[by_type[t] for t in types])  # fmt: skip
    moe = dict(num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512)
    return fields | _qwen_moe(hf, moe, hf.get("shared_expert_intermediate_size", 512), True)


def _qwen3_next_rope(hf: HFConfig) -> dict[str, Any]:
    """The shared RoPE fields and `partial_rotary_factor` (in `rope_parameters` or at the top,
    transformers' default 0.25)."""
    params = flat_rope_params(hf)
    factor = params.pop("partial_rotary_factor", None) or hf.get("partial_rotary_factor", 0.25)
    theta, scaling = rope(hf, params, hf.get("rope_theta") or 10000.0)
    return dict(rope_theta=theta, rope_scaling=scaling, partial_rotary_factor=factor)


def _drop_mtp(state: dict[str, Any]) -> dict[str, Any]:
    """Without the multi-token-prediction head (`mtp.*`), which transformers ignores too."""
    return {name: tensor for name, tensor in state.items() if not name.startswith("mtp.")}


def _qwen2_moe_layer_kinds(hf: HFConfig) -> list[LayerKind]:
    # As Qwen2MoeConfig: even layers below max_window_layers slide.
    first_full = hf.get("max_window_layers", 28)
    return _qwen_window_kinds(hf, lambda i: bool((i + 1) % 2) and i < first_full)


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
            f"{_arch(hf)}: layer_types {sorted(unknown)} are not supported; supported: "
            f"{sorted(by_type)}"
        )
    if len(types) != hf["num_hidden_layers"]:
        raise ValueError(
            f"{_arch(hf)}: {len(types)} layer_types for num_hidden_layers="
            f"{hf['num_hidden_layers']}; give one type per layer"
        )
    return [by_type[t] for t in types]


def _check_activation(hf: HFConfig, key: str, supported: str) -> None:
    act = hf.get(key) or supported
    if act != supported:
        raise ValueError(f"{_arch(hf)}: {key}={act!r} is not supported, only {supported!r}")


# ---- the registry -------------------------------------------------------------------------------

ARCHITECTURES: dict[str, Callable[[HFConfig], dict[str, Any]]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "Phi3ForCausalLM": _phi3,
    "Gemma2ForCausalLM": _gemma2,
    "Gemma3ForCausalLM": _gemma3,
    "GptOssForCausalLM": _gpt_oss,
    "MixtralForCausalLM": _mixtral,
    "Qwen2MoeForCausalLM": _qwen2_moe,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "Llama4ForCausalLM": llama4_fields,
    "Qwen3NextForCausalLM": _qwen3_next,
}

# Architectures whose RoPE is not the shared `rope_parameters` / `rope_scaling` + `rope_theta`.
ROPE_FIELDS: dict[str, Callable[[HFConfig], dict[str, Any]]] = {
    "Phi3ForCausalLM": _phi3_rope,
    "Gemma3ForCausalLM": _gemma3_rope,
    "Llama4ForCausalLM": llama4_rope,
    "Qwen3NextForCausalLM": _qwen3_next_rope,
}

# `model_type` -> architecture, for configs without `architectures`.
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}

# Checkpoint weight names that differ from the model's (regex, replacement), applied in order.
WEIGHT_RENAMES: dict[str, list[tuple[str, str]]] = {
    "MixtralForCausalLM": [
        (r"\.block_sparse_moe\.", ".mlp."),
        (r"(\.mlp\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
        (r"(\.mlp\.experts\.\d+)\.w3\.", r"\1.up_proj."),
        (r"(\.mlp\.experts\.\d+)\.w2\.", r"\1.down_proj."),
    ],
    "Llama4ForCausalLM": [(r"\.feed_forward\.", ".mlp.")],
    "Qwen3NextForCausalLM": [(r"\.linear_attn\.", ".self_attn.")],
}

# Checkpoint weights whose layout differs from the model's, rearranged after the renames.
WEIGHT_LAYOUTS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "Llama4ForCausalLM": llama4_expert_weights,
    "Qwen3NextForCausalLM": _drop_mtp,
}
