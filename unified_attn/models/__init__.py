"""Decoders (Llama, Mistral, Qwen 2/3, Phi-3, Gemma 2/3, GPT-OSS, Mixtral, Qwen2-MoE families;
DeepSeek-V2/V3 with latent attention; DeepSeek-V4 with sliding + compressed attention) whose
layers attend through shared backend instances."""

from unified_attn.models.config import LayerKind, ModelConfig, MoEConfig, RopeScaling
from unified_attn.models.decoder import DecoderModel
from unified_attn.models.deepseek import DeepseekForCausalLM
from unified_attn.models.deepseek_config import DeepseekConfig
from unified_attn.models.deepseek_v4 import DeepseekV4Config, DeepseekV4ForCausalLM
from unified_attn.models.hf import load_hf_model, supported_architectures
from unified_attn.models.presets import MLA_PRESETS, PRESETS, V4_PRESETS, get_preset
from unified_attn.models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = [
    "MLA_PRESETS",
    "PRESETS",
    "V4_PRESETS",
    "ByteTokenizer",
    "DecoderModel",
    "DeepseekConfig",
    "DeepseekForCausalLM",
    "DeepseekV4Config",
    "DeepseekV4ForCausalLM",
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
