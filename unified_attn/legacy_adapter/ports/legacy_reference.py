"""`LegacyReferenceBackend`: the pure-torch reference written the four-class way.

The builder turns each group's batch into index tensors every step (cache-write targets, the
padded decode batch, one key gather per prefill request); the per-layer impl writes the cache
and gathers keys from that metadata and shares only the math helpers `attend` / `attend_batch`
with the native reference backend. Cache layout: `[2, num_blocks, block_size, Hkv, D]`.
"""

from __future__ import annotations

import itertools

import attrs
import torch

from unified_attn.backend import LayerConfig
from unified_attn.backends.reference import attend, attend_batch
from unified_attn.legacy_adapter.interfaces import (
    LegacyAttentionLayer,
    LegacyAttentionMetadata,
    LegacyAttentionMetadataBuilder,
    LegacyCommonAttentionMetadata,
)
from unified_attn.legacy_adapter.ports.legacy_common import PortedBackend, PortedImpl


@attrs.frozen
class PrefillSpan:
    """One request with more than one new token: its tokens `[start, end)` and its keys."""

    start: int
    end: int
    num_computed: int
    key_blocks: torch.Tensor  # [S] physical block of every key position
    key_offsets: torch.Tensor  # [S]


@attrs.frozen
class LegacyReferenceMetadata(LegacyAttentionMetadata):
    num_actual_tokens: int
    write_rows: torch.Tensor  # [W] tokens with a slot
    write_blocks: torch.Tensor  # [W]
    write_offsets: torch.Tensor  # [W]
    decode_tokens: torch.Tensor  # [Bd] the query token of every decode request
    decode_positions: torch.Tensor  # [Bd, 1]
    decode_key_blocks: torch.Tensor  # [Bd, S]
    decode_key_offsets: torch.Tensor  # [S]
    decode_key_valid: torch.Tensor  # [Bd, S]
    prefills: tuple[PrefillSpan, ...]
    attention_chunk_size: int | None


class LegacyReferenceMetadataBuilder(LegacyAttentionMetadataBuilder[LegacyReferenceMetadata]):
    def build(
        self, common_prefix_len: int, common_attn_metadata: LegacyCommonAttentionMetadata
    ) -> LegacyReferenceMetadata:
        cm = common_attn_metadata
        bs = self.kv_cache_spec.block_size
        qsl = cm.query_start_loc_cpu.tolist()[: cm.num_reqs + 1]
        seq_lens = cm.seq_lens_cpu.tolist()[: cm.num_reqs]
        computed = cm.num_computed_tokens_cpu.tolist()[: cm.num_reqs]
        table = cm.block_table_tensor.cpu().long()  # [B, max_blocks]
        query_lens = [b - a for a, b in itertools.pairwise(qsl)]
        decodes = [i for i, n in enumerate(query_lens) if n == 1]
        slots = cm.slot_mapping[: cm.num_actual_tokens].cpu()
        rows = torch.nonzero(slots >= 0).flatten()
        max_len = max((seq_lens[i] for i in decodes), default=0)
        key_pos = torch.arange(max_len)
        decode_pos = torch.tensor([seq_lens[i] - 1 for i in decodes], dtype=torch.long)
        prefills = tuple(
            self._prefill_span(table[i], qsl[i], qsl[i + 1], computed[i], seq_lens[i], bs)
            for i, n in enumerate(query_lens)
            if n != 1
        )
        to = self.device
        return LegacyReferenceMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            write_rows=rows.to(to),
            write_blocks=(slots[rows] // bs).to(to),
            write_offsets=(slots[rows] % bs).to(to),
            decode_tokens=torch.tensor([qsl[i] for i in decodes], dtype=torch.long, device=to),
            decode_positions=decode_pos[:, None].to(to),
            decode_key_blocks=table[decodes][:, key_pos // bs].to(to),
            decode_key_offsets=(key_pos % bs).to(to),
            decode_key_valid=(key_pos < decode_pos[:, None] + 1).to(to),
            prefills=prefills,
            attention_chunk_size=getattr(self.kv_cache_spec, "attention_chunk_size", None),
        )

    def _prefill_span(
        self, row: torch.Tensor, start: int, end: int, computed: int, seq_len: int, bs: int
    ) -> PrefillSpan:
        pos = torch.arange(seq_len)
        blocks, offsets = row[pos // bs].to(self.device), (pos % bs).to(self.device)
        return PrefillSpan(start, end, computed, blocks, offsets)


class LegacyReferenceImpl(PortedImpl[LegacyReferenceMetadata]):
    math_layer: LayerConfig | None = None  # the parameters in the math helpers' form

    def forward(
        self,
        layer: LegacyAttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: LegacyReferenceMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        md = attn_metadata
        key_cache, value_cache = kv_cache.unbind(0)  # [num_blocks, block_size, Hkv, D] each
        key_cache[md.write_blocks, md.write_offsets] = key[md.write_rows]
        value_cache[md.write_blocks, md.write_offsets] = value[md.write_rows]
        math_layer = self._math_layer(layer.layer_name, md.attention_chunk_size)
        alibi = self._alibi(query.device)
        if len(md.decode_tokens):
            keys = (md.decode_key_blocks, md.decode_key_offsets)
            output[md.decode_tokens] = attend_batch(
                math_layer,
                query[md.decode_tokens][:, None],
                key_cache[keys],
                value_cache[keys],
                md.decode_positions,
                md.decode_key_valid,
                self.sinks,
                alibi,
            )[:, 0]
        for span in md.prefills:
            keys = (span.key_blocks, span.key_offsets)
            output[span.start : span.end] = attend(
                math_layer,
                query[span.start : span.end],
                key_cache[keys],
                value_cache[keys],
                span.num_computed,
                self.sinks,
                alibi,
            )
        return output

    def _math_layer(self, name: str, chunk: int | None) -> LayerConfig:
        if self.math_layer is None or self.math_layer.chunk_size != chunk:
            self.math_layer = LayerConfig(
                name,
                self.num_heads,
                self.num_kv_heads,
                self.head_size,
                self.scale,
                sliding_window=self.sliding_window,
                logits_soft_cap=self.logits_soft_cap,
                attn_type=self.attn_type,
                chunk_size=chunk,
            )
        return self.math_layer


class LegacyReferenceBackend(PortedBackend):
    legacy_name = "reference"
    impl_cls = LegacyReferenceImpl
    builder_cls = LegacyReferenceMetadataBuilder
    metadata_cls = LegacyReferenceMetadata

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        # Decodes are attended together over the batch's longest key range (padded, masked):
        # a decode's bits depend on its companions (the conformance suite's invariance cells).
        return False
