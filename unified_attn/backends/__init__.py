"""Attention backends implementing the unified contract."""

from unified_attn.backends.deepseek_v4_window import DeepseekV4WindowBackend
from unified_attn.backends.mla import MLAReferenceBackend
from unified_attn.backends.reference import ReferenceAttentionBackend

__all__ = ["DeepseekV4WindowBackend", "MLAReferenceBackend", "ReferenceAttentionBackend"]
