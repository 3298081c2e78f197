"""What a backend is told about its layers and each step: `AttentionType`, `LayerConfig`,
`CommonAttentionMetadata`, and the `CacheConfig` triple a backend declares."""

from __future__ import annotations

import enum
from typing import Any

import attrs
import torch

from unified_attn.managers import SingleTypeKVCacheManager
from unified_attn.tensor_specs import KVCacheTensorSpec
from unified_attn.utils import optional_positive, optional_positive_int, positive_int

CacheConfig = tuple[type[SingleTypeKVCacheManager], Any, KVCacheTensorSpec]


class AttentionType(str, enum.Enum):
    DECODER = "decoder"  # causal self-attention over the KV cache
    ENCODER = "encoder"  # bidirectional, over the request's own tokens (enc-dec encoder)
    ENCODER_ONLY = "encoder_only"  # bidirectional, no KV cache
    ENCODER_DECODER = "encoder_decoder"  # cross-attention to encoder outputs


@attrs.frozen
class LayerConfig:
    """Per-layer attention parameters. Tensors (sinks, alibi slopes) are forward kwargs."""

    name: str
    num_heads: int = attrs.field(validator=positive_int)
    num_kv_heads: int = attrs.field(validator=positive_int)
    head_size: int = attrs.field(validator=positive_int)
    scale: float
    sliding_window: int | None = attrs.field(default=None, validator=optional_positive_int)
    logits_soft_cap: float | None = attrs.field(default=None, validator=optional_positive)
    attn_type: AttentionType = AttentionType.DECODER
    chunk_size: int | None = attrs.field(default=None, validator=optional_positive_int)

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"layer {self.name}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )

    @property
    def causal(self) -> bool:
        return self.attn_type == AttentionType.DECODER


@attrs.frozen
class CommonAttentionMetadata:
    """Backend-agnostic batch description, built once per step by the runner and shared by every
    backend's `prep_forward`.

    Requests are rows `0..B-1`; their new tokens are packed: request i owns token rows
    `[query_start_loc[i], query_start_loc[i + 1])` at positions `num_computed_tokens[i] + j`.
    Fields named `*_cpu` and the plain ints are host values; the others live on the model's
    device. Under CUDA graphs the device tensors are views of persistent buffers, padded to the
    captured batch size (padding rows: sequence length 0, slot -1).
    """

    query_start_loc: torch.Tensor  # device [B + 1] int32
    query_start_loc_cpu: torch.Tensor  # host [B + 1] int32
    seq_lens: torch.Tensor  # device [B] int32: computed + new tokens
    seq_lens_cpu: torch.Tensor  # host [B] int32
    num_computed_tokens_cpu: torch.Tensor  # host [B] int32: tokens already in the cache
    positions: torch.Tensor  # device [T] int64
    num_reqs: int  # host: B
    num_actual_tokens: int  # host: T (tokens with data; device tensors may be longer)
    max_query_len: int  # host
    max_seq_len: int  # host
    slot_mappings: dict[int, torch.Tensor]  # device: group id -> [T] int64 slot, -1 = padding
    block_sizes: dict[int, int] = attrs.Factory(dict)  # host: group id -> tokens per block
    # Encoder-decoder models: each request's encoder length (0: none). A cross-attention
    # group's slot mapping is [E], the slots of the encoder tokens written this step (those
    # of requests whose encoder ran), in the order of the key/value rows its layers get.
    encoder_seq_lens_cpu: torch.Tensor | None = None  # host [B] int32
    encoder_seq_lens: torch.Tensor | None = None  # device [B] int32
    # A CUDA-graph decode step (capture and replays): every row, padding included, has
    # `max_query_len` tokens; the `*_cpu` fields are placeholders (plan from the device ones).
    graph_step: bool = False
    # Speculative decoding over state layers (`StateManager` mode "none" with a slot per draft
    # token): each request's draft tokens verified this step, and the column of its state table
    # holding its state (the last token kept by its previous step). None: no drafts.
    num_drafts_cpu: torch.Tensor | None = None  # host [B] int32
    state_columns_cpu: torch.Tensor | None = None  # host [B] int32
    # The step's block tables on the host (group id -> [B, width] int32), for backends that
    # plan on the host: reading the device ones would make the host wait for the device.
    # None where the runner has none (graph steps, callers that build metadata by hand).
    block_tables_cpu: dict[int, torch.Tensor] | None = None

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    def host_lists(self) -> tuple[list[int], list[int], list[int]]:
        """The per-request host fields as lists (what host planning indexes request by
        request), cut to the `num_reqs` requests: query start locations `[B + 1]`, sequence
        lengths `[B]` and computed tokens `[B]`."""
        num_reqs = self.num_reqs
        return (
            self.query_start_loc_cpu.tolist()[: num_reqs + 1],
            self.seq_lens_cpu.tolist()[:num_reqs],
            self.num_computed_tokens_cpu.tolist()[:num_reqs],
        )
