"""DeepSeek-V4 checkpoints: `config.json` -> `DeepseekV4Config`, and the weights.

transformers writes V4 checkpoints in DeepSeek's original layout (`layers.i.attn.wq_a`,
`ffn.experts.{e}.w1`, `attn.compressor.ape`, ...) and renames them on load; `checkpoint_names`
applies the same renames (and stacks the per-expert matrices), so both layouts load. Missing
config fields take transformers' `DeepseekV4Config` defaults, legacy fields (`compress_ratios`,
`compress_rate_csa/hca`, `num_hash_layers`, `qk_rope_head_dim`, a flat `rope_scaling`) fold in
as transformers folds them.
"""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path
from typing import Any

import torch

from unified_attn.backend import AttentionBackend
from unified_attn.models.deepseek_v4 import DeepseekV4Config, DeepseekV4ForCausalLM
from unified_attn.models.deepseek_v4_attention import CSA, HCA, SLIDING
from unified_attn.models.fp8_checkpoint import fp8_blocks
from unified_attn.models.hf_checkpoint import CheckpointFormat, check_state
from unified_attn.models.hf_config import HFConfig, is_deepseek_v4
from unified_attn.models.hf_rope import rope
from unified_attn.models.moe import stack_expert_weights

_DEFAULTS: dict[str, Any] = dict(
    vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43,
    num_attention_heads=64, num_key_value_heads=1, head_dim=512, q_lora_rank=1024,
    num_experts_per_tok=6, n_routed_experts=256, scoring_func="sqrtsoftplus",
    routed_scaling_factor=1.5, max_position_embeddings=1048576, rope_theta=10000.0,
    compress_rope_theta=160000.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    swiglu_limit=10.0, sliding_window=128, o_groups=8, o_lora_rank=1024, index_n_heads=64,
    index_head_dim=128, index_topk=512, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
    tie_word_embeddings=False, mlp_bias=False, hidden_act="silu",
)  # fmt: skip
_COPIED = (
    "vocab_size", "hidden_size", "moe_intermediate_size", "head_dim", "q_lora_rank", "o_groups",
    "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim", "index_topk", "hc_mult",
    "hc_sinkhorn_iters", "hc_eps", "n_routed_experts", "num_experts_per_tok", "scoring_func",
    "routed_scaling_factor", "swiglu_limit", "rms_norm_eps", "max_position_embeddings",
    "bos_token_id", "mlp_bias", "tie_word_embeddings",
)  # fmt: skip
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}  # transformers' legacy `compress_ratios` map


def deepseek_v4_config_from_hf(hf: HFConfig, name: str = "hf") -> DeepseekV4Config:
    """A `DeepseekV4Config` from DeepSeek-V4's `config.json`."""
    if not is_deepseek_v4(hf):
        raise ValueError(
            f"checkpoint {name}: config.json names {hf.get('architectures')} / model_type "
            f"{hf.get('model_type')!r}, not DeepseekV4ForCausalLM"
        )
    values = {**_DEFAULTS, **hf}
    _refuse_unsupported(values, name)
    layers = values["num_hidden_layers"]
    fields = {key: values[key] for key in _COPIED}
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    rates |= values.get("compress_rates") or {}
    rates[CSA] = values.get("compress_rate_csa") or rates[CSA]
    rates[HCA] = values.get("compress_rate_hca") or rates[HCA]
    head_dim = values["head_dim"]
    partial = values.get("partial_rotary_factor") or (
        values["qk_rope_head_dim"] / head_dim if values.get("qk_rope_head_dim") else 64 / 512
    )
    main, compress = _rope_params(values)
    return DeepseekV4Config(
        **fields,
        name=name,
        num_layers=layers,
        num_heads=values["num_attention_heads"],
        qk_rope_head_dim=int(head_dim * partial),
        layer_types=_layer_types(values, layers),
        mlp_layer_types=_mlp_layer_types(values, layers),
        csa_compress_rate=rates[CSA],
        hca_compress_rate=rates[HCA],
        eos_token_ids=values["eos_token_id"],
        **_rope_fields(values, main, "rope"),
        **_rope_fields(values, compress, "compress_rope"),
    )


def _refuse_unsupported(values: HFConfig, name: str) -> None:
    fp8_blocks(values, name)  # a quantization the loader cannot read is refused
    act, kv_heads = values["hidden_act"], values["num_key_value_heads"]
    if act != "silu" or kv_heads != 1:
        raise ValueError(
            f"checkpoint {name}: hidden_act={act!r}, num_key_value_heads={kv_heads}; DeepSeek-V4 "
            "layers are shared-KV (num_key_value_heads 1) with SiLU experts"
        )


def _layer_types(values: HFConfig, layers: int) -> list[str]:
    if values.get("layer_types"):
        return list(values["layer_types"][:layers])
    ratios = values.get("compress_ratios")
    if ratios:
        unknown = sorted({r for r in ratios if r not in _RATIO_TO_TYPE})
        if unknown:
            raise ValueError(
                f"compress_ratios has {unknown}; transformers maps only {sorted(_RATIO_TO_TYPE)}"
            )
        return [_RATIO_TO_TYPE[r] for r in ratios[:layers]]
    interleave = [CSA if i % 2 else HCA for i in range(max(layers - 2, 0))]
    return ([HCA] * min(layers, 2) + interleave)[:layers]


def _mlp_layer_types(values: HFConfig, layers: int) -> list[str]:
    if values.get("mlp_layer_types"):
        return list(values["mlp_layer_types"][:layers])
    num_hash = values.get("num_hash_layers")
    num_hash = 3 if num_hash is None else num_hash
    return (["hash_moe"] * min(layers, num_hash) + ["moe"] * max(0, layers - num_hash))[:layers]


def _rope_params(values: HFConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """The "main" and "compress" RoPE parameters, nested as transformers saves them or built
    from flat ones as its config does (YaRN only on the compressed branch, attention factor 1)."""
    params = values.get("rope_parameters") or values.get("rope_scaling") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        return params["main"], params["compress"]
    flat = {k: v for k, v in params.items() if k not in ("main", "compress")}
    main = {"rope_type": "default", "rope_theta": values["rope_theta"]}
    compress = {**flat, "rope_theta": values["compress_rope_theta"]}
    compress.setdefault("rope_type", compress.pop("type", "default"))
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return main, compress


def _rope_fields(values: HFConfig, params: dict[str, Any], prefix: str) -> dict[str, Any]:
    params = {k: v for k, v in params.items() if k != "partial_rotary_factor"}
    theta, scaling = rope(values, params, values[f"{prefix}_theta"])
    return {f"{prefix}_theta": theta, f"{prefix}_scaling": scaling}


# ---- weights ------------------------------------------------------------------------------------

# transformers' load-time renames of DeepSeek's original names, applied in order
_RENAMES = [
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"), (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_(fn|base|scale)", r"hc_head.hc_\1"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)", r".\1_hc.\2"), (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."),
    (r"\.ape", ".position_bias"), (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]  # fmt: skip


def checkpoint_names(raw: dict[str, torch.Tensor], config: DeepseekV4Config) -> dict[str, Any]:
    """Our parameter names: renamed as transformers does, per-expert `w1`/`w3` (gate/up) stacked
    into `gate_up_proj [E, 2I, D]` and `w2` into `down_proj [E, D, I]`; RoPE buffers,
    multi-token-prediction weights and a tied head's copy dropped."""
    state: dict[str, torch.Tensor] = {}
    for name, tensor in raw.items():
        key = _renamed(name)
        if key is not None and not _dropped(key, config):
            state[key] = tensor
    return stack_expert_weights(state, "w1", "w3", "w2")


def _renamed(name: str) -> str | None:
    body = name.removeprefix("model.")
    if body.startswith("mtp."):
        return None
    for pattern, replacement in _RENAMES:
        body = re.sub(pattern, replacement, body)
    return body if body.startswith("lm_head.") else f"model.{body}"


def _dropped(key: str, config: DeepseekV4Config) -> bool:
    parts = key.split(".")
    mtp = key.startswith("model.layers.") and int(parts[2]) >= config.num_layers
    tied = config.tie_word_embeddings and key == "lm_head.weight"
    return mtp or tied or "rotary_emb." in key


def load_deepseek_v4(
    path: str | Path,
    backend_cls: type[AttentionBackend],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    backend_options: dict[str, Any] | None = None,
) -> tuple[DeepseekV4ForCausalLM, Any]:
    """The model (weights loaded, cast to `dtype`) and the checkpoint's tokenizer, if any."""
    return _FORMAT.load(
        path, backend_cls, dtype=dtype, device=device, backend_options=backend_options
    )


_FORMAT = CheckpointFormat(
    model_cls=DeepseekV4ForCausalLM,
    read_config=deepseek_v4_config_from_hf,
    model_names=checkpoint_names,
    check=partial(check_state, hint="num_hidden_layers, layer_types, mlp_layer_types, experts"),
    fp8=True,
)
