"""`LegacyTritonBackend`: the Triton kernels behind the four legacy classes.

The builder copies the group's batch into its metadata every step and plans split-KV for
decode batches too small to fill the GPU (its scratch buffers live in the builder); the
per-layer impl launches `write_kv_cache` and `unified_attention`. Cache layout:
`[2, num_blocks, block_size, Hkv, D]`.
"""

from __future__ import annotations

import attrs
import torch

from unified_attn.backends.triton.ops import (
    SUPPORTED_DTYPES,
    SplitPlan,
    SplitScratch,
    interpreter_on,
    plan_split,
    unified_attention,
    write_kv_cache,
)
from unified_attn.legacy_adapter.interfaces import (
    LegacyAttentionLayer,
    LegacyAttentionMetadata,
    LegacyAttentionMetadataBuilder,
    LegacyCommonAttentionMetadata,
)
from unified_attn.legacy_adapter.ports.legacy_common import PortedBackend, PortedImpl
from unified_attn.legacy_adapter.specs import AttentionSpec


@attrs.frozen
class LegacyTritonMetadata(LegacyAttentionMetadata):
    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64
    attention_chunk_size: int | None
    split: SplitPlan | None
    scratch: SplitScratch


class LegacyTritonMetadataBuilder(LegacyAttentionMetadataBuilder[LegacyTritonMetadata]):
    def __init__(
        self, kv_cache_spec: AttentionSpec, layer_names: list[str], device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, device)
        self.scratch = SplitScratch()  # grown by the first split launch, then reused

    def build(
        self, common_prefix_len: int, common_attn_metadata: LegacyCommonAttentionMetadata
    ) -> LegacyTritonMetadata:
        cm = common_attn_metadata
        return LegacyTritonMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            num_reqs=cm.num_reqs,
            max_query_len=cm.max_query_len,
            query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            attention_chunk_size=getattr(self.kv_cache_spec, "attention_chunk_size", None),
            split=plan_split(
                max_query_len=cm.max_query_len,
                max_seq_len=cm.max_seq_len,
                num_reqs=cm.num_reqs,
                num_kv_heads=self.kv_cache_spec.num_kv_heads,
                device=self.device,
            ),
            scratch=self.scratch,
        )


class LegacyTritonImpl(PortedImpl[LegacyTritonMetadata]):
    # Kernel-ready float32 copies, made on the first forward (the launcher wants float32; the
    # ALiBi slopes are float32 already).
    sinks_f32: torch.Tensor | None = None

    def forward(
        self,
        layer: LegacyAttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: LegacyTritonMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        md = attn_metadata
        n = md.num_actual_tokens
        key_cache, value_cache = kv_cache.unbind(0)  # [num_blocks, block_size, Hkv, D] each
        write_kv_cache(key[:n], value[:n], key_cache, value_cache, md.slot_mapping[:n])
        unified_attention(
            query[:n], key_cache, value_cache, output[:n],
            query_start_loc=md.query_start_loc, seq_lens=md.seq_lens,
            block_table=md.block_table, num_seqs=md.num_reqs, max_query_len=md.max_query_len,
            scale=self.scale, causal=True, window=self.sliding_window,
            chunk=md.attention_chunk_size, soft_cap=self.logits_soft_cap,
            sinks=self._sinks(), alibi_slopes=self._alibi(query.device),
            split=md.split, scratch=md.scratch,
        )  # fmt: skip
        return output

    def _sinks(self) -> torch.Tensor | None:
        if self.sinks is not None and self.sinks_f32 is None:
            self.sinks_f32 = self.sinks.float()
        return self.sinks_f32


class LegacyTritonBackend(PortedBackend):
    supported_dtypes = SUPPORTED_DTYPES
    legacy_name = "triton"
    impl_cls = LegacyTritonImpl
    builder_cls = LegacyTritonMetadataBuilder
    metadata_cls = LegacyTritonMetadata

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(range(16, 257, 16))

    @classmethod
    def supports_device(cls, device_type: str) -> bool:
        return device_type == "cuda" or (device_type == "cpu" and interpreter_on())
