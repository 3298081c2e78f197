"""Decoders (Llama, Mistral, Qwen 2/3, Phi-3, Gemma 2/3, GPT-OSS, Mixtral, Qwen2-MoE families)
whose layers attend through shared backend instances."""

from unified_attn.models.config import LayerKind, ModelConfig, MoEConfig, RopeScaling
from unified_attn.models.decoder import DecoderModel
from unified_attn.models.hf import load_hf_model, supported_architectures
from unified_attn.models.presets import PRESETS, get_preset
from unified_attn.models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = [
    "PRESETS",
    "ByteTokenizer",
    "DecoderModel",
    "HFTokenizer",
    "LayerKind",
    "MoEConfig",
    "ModelConfig",
    "RopeScaling",
    "Tokenizer",
    "get_preset",
    "load_hf_model",
    "supported_architectures",
]
