"""What an MLA backend checks: what it cannot be built with (`construction_problems`) and each
forward input's shape, dtype and device (`check_mla_tensor`)."""

from __future__ import annotations

from typing import Any

import torch

from unified_attn.backend import AttentionBackend, AttentionType, LayerConfig, check_dtype_device
from unified_attn.tensor_specs.paged import FP8_KV_DTYPE


def construction_problems(backend: AttentionBackend, kv_lora_rank: Any) -> list[str]:
    """What an MLA backend cannot be built with (empty: fine)."""
    problems = []
    if backend.num_kv_heads != 1:
        problems.append(
            f"num_kv_heads={backend.num_kv_heads}, expected 1 (one latent per token, shared "
            "by every head)"
        )
    if not isinstance(kv_lora_rank, int) or not 0 < kv_lora_rank < backend.head_size:
        problems.append(
            f"kv_lora_rank={kv_lora_rank!r}, expected an int in (0, head_size={backend.head_size})"
            " (head_size = kv_lora_rank + qk_rope_head_dim)"
        )
    if backend.kv_cache_dtype not in (backend.dtype, FP8_KV_DTYPE):
        problems.append(
            f"kv_cache_dtype={backend.kv_cache_dtype} is neither dtype={backend.dtype} nor fp8; "
            "use kv_cache_dtype='auto' or 'fp8'"
        )
    chunk, sinks = backend.attention_chunk_size, backend.num_sink_tokens
    if chunk is not None or sinks or backend.attn_type != AttentionType.DECODER:
        problems.append(
            f"attention_chunk_size={chunk}, num_sink_tokens={sinks}, attn_type="
            f"{backend.attn_type.value}: MLA layers are full or sliding-window decoder layers"
        )
    return problems


def row_size(tensor: torch.Tensor) -> int:
    size = 1
    for dim in tensor.shape[1:]:
        size *= dim
    return size


def check_mla_tensor(
    layer: LayerConfig,
    what: str,
    tensor: torch.Tensor,
    shape: tuple[int, int],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    if (tensor.shape[0], row_size(tensor)) != shape:
        raise ValueError(
            f"layer {layer.name}: {what} has shape {tuple(tensor.shape)}, expected {shape} "
            "(see unified_attn.backends.mla for what MLA's query, key and value hold)"
        )
    check_dtype_device(layer, what, tensor, dtype, device)
