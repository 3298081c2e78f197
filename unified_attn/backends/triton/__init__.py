"""The Triton paged-attention backend."""

from unified_attn.backends.triton.backend import TritonAttentionBackend

__all__ = ["TritonAttentionBackend"]
