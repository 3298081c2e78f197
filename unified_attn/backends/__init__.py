"""Attention backends implementing the unified contract."""

from unified_attn.backends.mla import MLAReferenceBackend
from unified_attn.backends.reference import ReferenceAttentionBackend

__all__ = ["MLAReferenceBackend", "ReferenceAttentionBackend"]
