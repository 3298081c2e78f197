"""DeepSeek-V3.2 checkpoints in Hugging Face layout: `config.json` into a `DeepseekV32Config`
(`deepseek_v32_config_from_hf`: read as DeepSeek-V3's, plus the indexer's fields; layer
patterns transformers allows but the model does not run are refused by name) and the weights as
a checked state dict (`load_deepseek_v32`, the V2/V3 loader's steps)."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch

from unified_attn.backend import AttentionBackend
from unified_attn.models.deepseek_hf import _model_names, deepseek_config_from_hf
from unified_attn.models.deepseek_v32 import DeepseekV32Config, DeepseekV32ForCausalLM, v32_preset
from unified_attn.models.hf_checkpoint import CheckpointFormat, check_state
from unified_attn.models.hf_config import V32_ARCHITECTURES, V32_MODEL_TYPES, HFConfig

# transformers' DeepseekV32Config defaults where they differ from DeepSeek-V3's
_DEFAULTS: dict[str, Any] = dict(
    max_position_embeddings=163840, index_topk=2048, index_head_dim=128, index_n_heads=64
)
_INDEXER = ("index_topk", "index_head_dim", "index_n_heads")


def is_deepseek_v32(hf: HFConfig) -> bool:
    """True when `config.json` names DeepSeek-V3.2 (or, without `architectures`, its model
    type)."""
    archs = hf.get("architectures")
    if archs:
        return archs[0] in V32_ARCHITECTURES
    return hf.get("model_type", "") in V32_MODEL_TYPES


def deepseek_v32_config_from_hf(hf: HFConfig, name: str = "hf") -> DeepseekV32Config:
    """A `DeepseekV32Config` from DeepSeek-V3.2's `config.json`."""
    if not is_deepseek_v32(hf):
        raise ValueError(
            f"checkpoint {name}: config.json names {hf.get('architectures')} / model_type "
            f"{hf.get('model_type')!r}, not DeepseekV32ForCausalLM"
        )
    values = {**_DEFAULTS, **hf}
    _check_layer_types(values, name)
    values["first_k_dense_replace"] = _dense_layers(values, name)
    # the MLA part is DeepSeek-V3's, always with interleaved RoPE pairs
    as_v3 = {**values, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
             "rope_interleave": True}  # fmt: skip
    v3 = deepseek_config_from_hf(as_v3, name=name)
    topk, head_dim, heads = (int(values[key]) for key in _INDEXER)
    return v32_preset(v3, name, index_topk=topk, index_head_dim=head_dim, index_n_heads=heads)


def _check_layer_types(values: HFConfig, name: str) -> None:
    kinds = values.get("layer_types")
    if kinds is not None and set(kinds) - {"indexed_attention"}:
        raise ValueError(
            f"checkpoint {name}: layer_types={kinds}, expected 'indexed_attention' for every "
            "layer (DeepSeek Sparse Attention everywhere)"
        )


def _dense_layers(values: HFConfig, name: str) -> int:
    """The leading dense-MLP layers: `mlp_layer_types` ("dense" then "sparse") when given, else
    `first_k_dense_replace` (transformers' rule)."""
    kinds = values.get("mlp_layer_types")
    layers = values.get("num_hidden_layers", 0)
    if kinds is None:
        return min(int(values.get("first_k_dense_replace", 3)), layers)
    dense = kinds.count("dense")
    if list(kinds) != ["dense"] * dense + ["sparse"] * (len(kinds) - dense) or len(kinds) != layers:
        raise ValueError(
            f"checkpoint {name}: mlp_layer_types={kinds}, expected {layers} entries: 'dense' "
            "layers first, then 'sparse' (MoE) ones"
        )
    return dense


def load_deepseek_v32(
    path: str | Path,
    backend_cls: type[AttentionBackend],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    backend_options: dict[str, Any] | None = None,
) -> tuple[DeepseekV32ForCausalLM, Any]:
    """The model (weights loaded, cast to `dtype`) and the checkpoint's tokenizer, if any."""
    return _FORMAT.load(
        path, backend_cls, dtype=dtype, device=device, backend_options=backend_options
    )


_FORMAT = CheckpointFormat(
    model_cls=DeepseekV32ForCausalLM,
    read_config=deepseek_v32_config_from_hf,
    model_names=_model_names,
    check=partial(check_state, hint="layers, q_lora_rank, experts, mlp_layer_types, index_*"),
    fp8=True,
)
