"""Llama 4's text model (`Llama4ForCausalLM`, model_type `llama4_text`): its `config.json` as
`ModelConfig` fields, and its expert weights in the decoder's layout.

As `Llama4TextConfig` derives them: `no_rope_layers[i]` is 1 where layer i uses RoPE (default:
every `no_rope_layer_interval`-th layer is NoPE); `layer_types` (default: chunked attention of
`attention_chunk_size` on the RoPE layers, full attention on the NoPE ones); the MoE layers
(`moe_layers`, default every `interleave_moe_layer_step`-th) hold `num_local_experts` SwiGLU
experts of `intermediate_size` and a shared expert of that size, the other layers a dense
SwiGLU of `intermediate_size_mlp`.
"""

from __future__ import annotations

from typing import Any

import torch

from unified_attn.models.config import AttnTemperature, LayerKind, MoEConfig
from unified_attn.models.hf_rope import flat_rope_params, rope

HFConfig = dict[str, Any]
ARCH = "Llama4ForCausalLM"


def llama4_fields(hf: HFConfig) -> dict[str, Any]:
    """The `ModelConfig` fields of a Llama 4 text `config.json` beyond the shared ones."""
    act = hf.get("hidden_act") or "silu"
    if act != "silu":
        raise ValueError(f"{ARCH}: hidden_act={act!r} is not supported, only 'silu'")
    num_layers = hf["num_hidden_layers"]
    uses_rope = _rope_layers(hf, num_layers)
    bias = bool(hf.get("attention_bias", False))
    fields: dict[str, Any] = dict(
        attention_bias=bias,
        attention_output_bias=bias,
        head_size=hf.get("head_dim", 128) or hf["hidden_size"] // hf["num_attention_heads"],
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        bos_token_id=hf.get("bos_token_id", 1),
        eos_token_id=hf.get("eos_token_id", 2),
        rope_style="interleaved",
        nope_layers=[i for i, rope_on in enumerate(uses_rope) if not rope_on],
        qk_l2_norm=bool(hf.get("use_qk_norm", True)),
        attn_temperature=_temperature(hf),
        layer_kinds=_layer_kinds(hf, uses_rope),
    )
    return fields | _mlp_fields(hf, num_layers)


def llama4_rope(hf: HFConfig) -> dict[str, Any]:
    """RoPE as the shared readers, with Llama 4's default base 500000."""
    theta, scaling = rope(hf, flat_rope_params(hf), hf.get("rope_theta") or 500000.0)
    return dict(rope_theta=theta, rope_scaling=scaling)


def _rope_layers(hf: HFConfig, num_layers: int) -> list[bool]:
    """Per layer, whether it uses RoPE (`no_rope_layers`: 1 = RoPE, 0 = NoPE)."""
    flags = hf.get("no_rope_layers") or [
        int((i + 1) % hf.get("no_rope_layer_interval", 4) != 0) for i in range(num_layers)
    ]
    if len(flags) < num_layers or any(flag not in (0, 1) for flag in flags):
        raise ValueError(
            f"{ARCH}: no_rope_layers must hold a 0 (NoPE) or 1 (RoPE) for each of the "
            f"{num_layers} layers, got {flags}"
        )
    return [bool(flag) for flag in flags[:num_layers]]


def _layer_kinds(hf: HFConfig, uses_rope: list[bool]) -> list[LayerKind]:
    chunk = hf.get("attention_chunk_size", 8192)
    types = hf.get("layer_types") or [
        "chunked_attention" if on and chunk is not None else "full_attention" for on in uses_rope
    ]
    if len(types) != len(uses_rope):
        raise ValueError(
            f"{ARCH}: {len(types)} layer_types for num_hidden_layers={len(uses_rope)}; give one "
            "type per layer"
        )
    unknown = sorted(set(types) - {"chunked_attention", "full_attention"})
    if unknown or (chunk is None and "chunked_attention" in types):
        raise ValueError(
            f"{ARCH}: layer_types must be 'chunked_attention' (with an attention_chunk_size, "
            f"here {chunk}) or 'full_attention', got {unknown or ['chunked_attention']}"
        )
    return [LayerKind.full() if t == "full_attention" else LayerKind.chunked(chunk) for t in types]


def _temperature(hf: HFConfig) -> AttnTemperature | None:
    if not hf.get("attn_temperature_tuning", True):
        return None
    return AttnTemperature(floor_scale=hf.get("floor_scale", 8192),
                           attn_scale=hf.get("attn_scale", 0.1))  # fmt: skip


def _mlp_fields(hf: HFConfig, num_layers: int) -> dict[str, Any]:
    """Dense layers: SwiGLU of `intermediate_size_mlp`; MoE layers: sigmoid top-k routing into
    the experts' input, plus the shared expert, both of `intermediate_size`."""
    step = hf.get("interleave_moe_layer_step", 1)
    moe_layers = hf.get("moe_layers")
    if moe_layers is None:
        moe_layers = list(range(step - 1, num_layers, step))
    dense = hf.get("intermediate_size_mlp", 16384)
    if not moe_layers:
        return dict(intermediate_size=dense)
    expert_size = hf.get("intermediate_size", 8192)
    moe = MoEConfig(
        num_experts=hf.get("num_local_experts", 16),
        top_k=hf.get("num_experts_per_tok", 1),
        expert_kind="swiglu",
        router_softmax="sigmoid",
        scale_input=True,
        intermediate_size=expert_size,
        shared_expert_intermediate_size=expert_size,
    )
    dense_layers = [i for i in range(num_layers) if i not in set(moe_layers)]
    return dict(intermediate_size=dense, mlp_kind="moe", moe=moe, dense_mlp_layers=dense_layers)


def llama4_expert_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Llama 4 stores `experts.gate_up_proj [E, H, 2I]` and `experts.down_proj [E, I, H]`; the
    decoder's `RoutedExperts` holds them transposed, `[E, 2I, H]` (gate rows, then up rows)
    and `[E, H, I]`."""
    experts = (".experts.gate_up_proj", ".experts.down_proj")
    return {
        name: tensor.transpose(1, 2) if name.endswith(experts) and tensor.dim() == 3 else tensor
        for name, tensor in state.items()
    }
