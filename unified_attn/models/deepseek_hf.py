"""DeepSeek-V2/V3 checkpoints in Hugging Face layout: `config.json` into a `DeepseekConfig`
(`deepseek_config_from_hf`: transformers' defaults for missing fields, unsupported features
refused by name), and the weights as a checked state dict (`load_deepseek`).
Multi-token-prediction layers (`model.layers.{num_hidden_layers}.*` of real V3 checkpoints) are
dropped, as transformers does.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, cast

import torch

from unified_attn.backend import AttentionBackend
from unified_attn.models.deepseek import DeepseekForCausalLM
from unified_attn.models.deepseek_config import DeepseekConfig, Version
from unified_attn.models.fp8_checkpoint import fp8_blocks
from unified_attn.models.hf_checkpoint import CheckpointFormat, check_state
from unified_attn.models.hf_config import HFConfig, mla_version
from unified_attn.models.hf_rope import rope_fields
from unified_attn.models.moe import stack_expert_weights

# config.json fields a DeepSeek config copies unchanged, and their transformers defaults (a
# missing field takes its default; an explicit null stays None, as in transformers)
_COPIED = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "q_lora_rank",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
    "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group", "norm_topk_prob",
    "routed_scaling_factor", "first_k_dense_replace", "rms_norm_eps", "max_position_embeddings",
    "attention_bias", "mlp_bias", "tie_word_embeddings", "bos_token_id",
)  # fmt: skip
_RENAMED = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "eos_token_ids": "eos_token_id",
}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")  # fmt: skip
_SHARED_DEFAULTS: dict[str, Any] = dict(
    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536,
    rms_norm_eps=1e-6, norm_topk_prob=False, attention_bias=False, mlp_bias=False,
    tie_word_embeddings=False, n_group=None, topk_group=None, num_experts_per_tok=None,
)  # fmt: skip
_DEFAULTS: dict[Version, dict[str, Any]] = {
    "v2": dict(
        first_k_dense_replace=0, n_shared_experts=2, n_routed_experts=64,
        routed_scaling_factor=1.0, moe_intermediate_size=1407, topk_method="greedy",
        bos_token_id=1, eos_token_id=2, max_position_embeddings=2048,
    ),
    "v3": dict(
        first_k_dense_replace=3, n_shared_experts=1, n_routed_experts=256,
        routed_scaling_factor=2.5, moe_intermediate_size=2048, n_group=8, topk_group=4,
        num_experts_per_tok=8, norm_topk_prob=True, bos_token_id=0, eos_token_id=1,
        max_position_embeddings=4096, rope_interleave=True,
    ),
}  # fmt: skip
_V2_ROUTING = ("greedy", "group_limited_greedy")


def deepseek_config_from_hf(hf: HFConfig, name: str = "hf") -> DeepseekConfig:
    """A `DeepseekConfig` from DeepSeek-V2/V3's `config.json`."""
    version = cast("Version | None", mla_version(hf))
    if version is None:
        raise ValueError(
            f"checkpoint {name}: config.json names {hf.get('architectures')} / model_type "
            f"{hf.get('model_type')!r}, not DeepseekV2ForCausalLM or DeepseekV3ForCausalLM"
        )
    _refuse_unsupported(hf, name)
    missing = [key for key in _REQUIRED if key not in hf]
    if missing:
        raise ValueError(
            f"checkpoint {name}: config.json has no {missing}, which DeepSeek-"
            f"{version.upper()} needs; re-save the config with transformers' save_pretrained"
        )
    return DeepseekConfig(**_fields({**_SHARED_DEFAULTS, **_DEFAULTS[version], **hf}, name))


def _refuse_unsupported(hf: HFConfig, name: str) -> None:
    fp8_blocks(hf, name)  # a quantization the loader cannot read is refused
    act = hf.get("hidden_act") or "silu"
    method = hf.get("topk_method") or "greedy"
    if act != "silu" or (mla_version(hf) == "v2" and method not in _V2_ROUTING):
        raise ValueError(
            f"checkpoint {name}: hidden_act={act!r}, topk_method={method!r}; supported: "
            f"hidden_act 'silu' and (DeepSeek-V2) topk_method in {_V2_ROUTING}"
        )


def _fields(values: HFConfig, name: str) -> dict[str, Any]:
    """`DeepseekConfig` fields of `values` (config.json over the version's defaults)."""
    version = mla_version(values)
    fields = {key: values[key] for key in _COPIED}
    fields |= {ours: values[theirs] for ours, theirs in _RENAMED.items()}
    for flag in ("norm_topk_prob", "attention_bias", "mlp_bias", "tie_word_embeddings"):
        fields[flag] = bool(fields[flag])
    if version == "v3":
        routing = "sigmoid_group_limited"
        layout = "interleave" if values["rope_interleave"] else "halves"
    else:
        routing, layout = values.get("topk_method") or "greedy", "pairs"
    return fields | dict(
        name=name, version=version, routing=routing, rope_layout=layout, **rope_fields(values)
    )


def load_deepseek(
    path: str | Path,
    backend_cls: type[AttentionBackend],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    backend_options: dict[str, Any] | None = None,
) -> tuple[DeepseekForCausalLM, Any]:
    """The model (weights loaded, cast to `dtype`) and the checkpoint's tokenizer, if any."""
    return _FORMAT.load(
        path, backend_cls, dtype=dtype, device=device, backend_options=backend_options
    )


def _model_names(raw: dict[str, torch.Tensor], config: DeepseekConfig) -> dict[str, torch.Tensor]:
    """Without RoPE buffers, multi-token-prediction layers and a tied LM head's copy; the routed
    experts' per-expert matrices stacked (`moe.stack_expert_weights`)."""
    state = {}
    for name, tensor in raw.items():
        parts = name.split(".")
        mtp = name.startswith("model.layers.") and int(parts[2]) >= config.num_layers
        if not (mtp or name.endswith("rotary_emb.inv_freq")):
            state[name] = tensor
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return stack_expert_weights(state, "gate_proj", "up_proj", "down_proj")


# after `_model_names`, which it names
_FORMAT = CheckpointFormat(
    model_cls=DeepseekForCausalLM,
    read_config=deepseek_config_from_hf,
    model_names=_model_names,
    check=partial(check_state, hint="layers, q_lora_rank, experts, first_k_dense_replace"),
    fp8=True,
)
