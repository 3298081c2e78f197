"""Model families, each declared once to one registry (`base.py`): presets, how it reads a
Hugging Face config, how it builds and loads, how tensor parallelism shards it, how `plan` and
`models` describe it. The package's families: `decoder_family` (the Llama line and the
presets), `mla_family` (DeepSeek-V2/V3), `v32_family` (DeepSeek-V3.2), `v4_family`
(DeepSeek-V4), `encoders_family` (BERT, BART). docs/architecture.md, "Adding a model family"."""

from unified_attn.models.families.base import (
    AttentionKind,
    ModelFamily,
    ModelKind,
    families,
    family_for_hf,
    family_of,
    family_of_preset,
    kv_cache_options,
    preset_names,
    register_family,
    shape_names,
)
from unified_attn.models.families.decoder_family import DECODERS
from unified_attn.models.families.encoders_family import BART, BERT
from unified_attn.models.families.hybrid_family import HYBRIDS
from unified_attn.models.families.mla_family import DEEPSEEK_MLA
from unified_attn.models.families.v4_family import DEEPSEEK_V4
from unified_attn.models.families.v32_family import DEEPSEEK_V32

__all__ = [
    "BART",
    "BERT",
    "DECODERS",
    "DEEPSEEK_MLA",
    "DEEPSEEK_V4",
    "DEEPSEEK_V32",
    "HYBRIDS",
    "AttentionKind",
    "ModelFamily",
    "ModelKind",
    "families",
    "family_for_hf",
    "family_of",
    "family_of_preset",
    "kv_cache_options",
    "preset_names",
    "register_family",
    "shape_names",
]
