"""Translate a Hugging Face `config.json` into a `ModelConfig`: reading and checking the file, the
shared fields, then the architecture's own (`hf_families`, one function per architecture) and
its RoPE (`hf_rope`).

Sliding-window convention. transformers' `sliding_window_overlay(W)` (masking_utils.py, used by
the eager and sdpa masks of Mistral, Qwen2/3, Phi-3, Gemma 2/3, Mixtral and GPT-OSS) keeps key
`kv_idx` for query `q_idx` when `kv_idx > q_idx - W`, on top of the causal `kv_idx <= q_idx`: a
query at position p sees keys `[p - W + 1, p]`, W keys including itself. Its flash-attention path
passes `window_size=(W - 1, W - 1)`, the same set. That is exactly `LayerConfig.sliding_window =
W`, so `config.json`'s `sliding_window` is used unchanged.

Defaults. A field missing from `config.json` takes the value transformers' config class gives it
(e.g. Gemma 3's global RoPE base 1e6, Mixtral's 8 experts), so a config written by any
transformers version translates the way that version's model runs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from unified_attn.models.config import ModelConfig
from unified_attn.models.fp8_checkpoint import fp8_blocks
from unified_attn.models.hf_families import (
    ARCHITECTURES,
    MODEL_TYPES,
    ROPE_FIELDS,
    WEIGHT_LAYOUTS,
    WEIGHT_RENAMES,
)
from unified_attn.models.hf_rope import rope_fields

HFConfig = dict[str, Any]


# ---- reading config.json ------------------------------------------------------------------------


def read_hf_config(path: Path) -> HFConfig:
    """The parsed `config.json` of checkpoint directory `path`; a `ValueError` saying what is
    wrong when it is not a directory, has no `config.json`, or the file is not a JSON object."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(
            f"checkpoint {path} is not a directory; give a Hugging Face checkpoint directory "
            "(config.json and model.safetensors, as written by save_pretrained)"
        )
    file = path / "config.json"
    if not file.is_file():
        raise ValueError(
            f"checkpoint directory {path} has no config.json; a Hugging Face checkpoint holds "
            "config.json and model.safetensors (write both with save_pretrained)"
        )
    try:
        hf = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{file} is not valid JSON: {error}; fix the file or re-save the config with "
            "save_pretrained"
        ) from None
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{file} is not UTF-8 text ({error.reason} at byte {error.start}); re-save the "
            "config with save_pretrained"
        ) from None
    if not isinstance(hf, dict):
        raise ValueError(
            f"{file} holds a JSON {type(hf).__name__}, expected an object of config fields; "
            "re-save the config with save_pretrained"
        )
    return hf


# Encoder-only and encoder-decoder architectures (`hf_encoders`): architecture -> family.
ENCODER_ARCHITECTURES = {
    "BertModel": "bert",
    "BertForMaskedLM": "bert",
    "BartForConditionalGeneration": "bart",
    "BartModel": "bart",
}
ENCODER_MODEL_TYPES = {"bert": "bert", "bart": "bart"}


# DeepSeek's latent-attention decoders (`deepseek.py`, `deepseek_hf.py`): -> version.
MLA_ARCHITECTURES = {"DeepseekV2ForCausalLM": "v2", "DeepseekV3ForCausalLM": "v3"}
MLA_MODEL_TYPES = {"deepseek_v2": "v2", "deepseek_v3": "v3"}


def mla_version(hf: HFConfig) -> str | None:
    """The DeepSeek version ("v2" or "v3") when `config.json` names a DeepSeek MLA architecture
    (or, without `architectures`, its model type), else None."""
    archs = hf.get("architectures")
    if archs:
        return MLA_ARCHITECTURES.get(archs[0])
    return MLA_MODEL_TYPES.get(hf.get("model_type", ""))


# DeepSeek-V4's hybrid sliding / compressed attention (`deepseek_v4.py`, `load_deepseek_v4`).
V4_ARCHITECTURES = ("DeepseekV4ForCausalLM",)
V4_MODEL_TYPES = ("deepseek_v4",)
# DeepSeek-V3.2's sparse MLA (`deepseek_v32.py`, `deepseek_v32_hf.is_deepseek_v32`).
V32_ARCHITECTURES = ("DeepseekV32ForCausalLM",)
V32_MODEL_TYPES = ("deepseek_v32",)
# State-space hybrids (`hybrid_hf.py`, the hybrid family)
HYBRID_ARCHITECTURES = ("BambaForCausalLM", "GraniteMoeHybridForCausalLM", "Mamba2ForCausalLM",
                        "NemotronHForCausalLM")  # fmt: skip
HYBRID_MODEL_TYPES = ("mamba2", "bamba", "nemotron_h", "granitemoehybrid")


def is_hybrid(hf: HFConfig) -> bool:
    """True when `config.json` names a state-space hybrid (or, without `architectures`, its
    model type)."""
    archs = hf.get("architectures")
    if archs:
        return archs[0] in HYBRID_ARCHITECTURES
    return hf.get("model_type", "") in HYBRID_MODEL_TYPES


def is_deepseek_v4(hf: HFConfig) -> bool:
    """True when `config.json` names DeepSeek-V4 (or, without `architectures`, its model
    type)."""
    archs = hf.get("architectures")
    if archs:
        return archs[0] in V4_ARCHITECTURES
    return hf.get("model_type", "") in V4_MODEL_TYPES


def supported_architectures() -> list[str]:
    """The `architectures` entries of `config.json` that load, sorted (for the CLI's listing)."""
    return sorted([*ARCHITECTURES, *ENCODER_ARCHITECTURES, *MLA_ARCHITECTURES, *V4_ARCHITECTURES,
                   *V32_ARCHITECTURES, *HYBRID_ARCHITECTURES])  # fmt: skip


def encoder_family(hf: HFConfig) -> str | None:
    """"bert" or "bart" when `config.json` names an encoder-only or encoder-decoder
    architecture (or, without `architectures`, its model type), else None."""
    archs = hf.get("architectures")
    if archs:
        return ENCODER_ARCHITECTURES.get(archs[0])
    return ENCODER_MODEL_TYPES.get(hf.get("model_type", ""))


def rename_weight(architecture: str, name: str) -> str:
    """A checkpoint weight name as the model of `architecture` names the parameter."""
    for pattern, replacement in WEIGHT_RENAMES.get(architecture, []):
        name = re.sub(pattern, replacement, name)
    return name


def rearrange_weights(architecture: str, state: dict[str, Any]) -> dict[str, Any]:
    """The renamed checkpoint tensors in the model's layout (`hf_families.WEIGHT_LAYOUTS`)."""
    layout = WEIGHT_LAYOUTS.get(architecture)
    return state if layout is None else layout(state)


def config_from_hf(hf: HFConfig, name: str = "hf") -> ModelConfig:
    """A `ModelConfig` from `config.json`: shared fields, RoPE, then the architecture's own."""
    arch = architecture_of(hf)
    fp8_blocks(hf, f"{name} ({arch})")  # a quantization the loader cannot read is refused
    try:
        rope = ROPE_FIELDS.get(arch, rope_fields)(hf)
        fields = {**_common_fields(hf, name), **rope, **ARCHITECTURES[arch](hf)}
    except KeyError as error:
        raise ValueError(
            f"{arch}: config.json of {name} has no {error.args[0]!r}, which {arch} needs; "
            "re-save the config with transformers' save_pretrained"
        ) from None
    return ModelConfig(**fields)


def _common_fields(hf: HFConfig, name: str) -> dict[str, Any]:
    num_heads = hf["num_attention_heads"]
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
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
    )


def architecture_of(hf: HFConfig) -> str:
    """The supported architecture `config.json` names (or its `model_type` implies)."""
    if mla_version(hf) is not None:
        raise ValueError(
            f"{(hf.get('architectures') or [hf.get('model_type')])[0]} is a DeepSeek "
            "latent-attention model, not a Llama-family decoder: load it with "
            "unified_attn.models.deepseek_hf.load_deepseek (LLMEngine and `unified-attn run "
            "--model DIR` do so)"
        )
    if is_deepseek_v4(hf):
        raise ValueError(
            f"{(hf.get('architectures') or [hf.get('model_type')])[0]} is a DeepSeek-V4 model "
            "(sliding + compressed attention), not a Llama-family decoder: load it with "
            "unified_attn.models.deepseek_v4_hf.load_deepseek_v4 (LLMEngine and `unified-attn "
            "run --model DIR` do so)"
        )
    archs = hf.get("architectures") or [MODEL_TYPES.get(hf.get("model_type", ""))]
    supported = ", ".join(supported_architectures())
    if archs[0] is None:
        raise ValueError(
            f"config.json names no architecture ('architectures' is missing and model_type "
            f'{hf.get("model_type")!r} is not a supported one); set "architectures" to one of '
            f"the supported architectures: {supported}"
        )
    if archs[0] not in ARCHITECTURES:
        raise ValueError(
            f"architecture {archs[0]!r} is not supported; supported architectures: {supported}"
        )
    return str(archs[0])
