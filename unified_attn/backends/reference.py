"""The reference backend: plain torch, any device, every feature. The correctness oracle.

Readable rather than fast: attention is computed per request in float32 with an explicit mask.
`prep_forward` turns the batch into index tensors once per step; `forward` only indexes, writes
the cache and computes. With `kv_cache_dtype="fp8"` the cache holds float8 e4m3 (`kv_quant`):
writes quantize with saturation, reads dequantize to float32 before the attention.
"""

from __future__ import annotations

import itertools
from typing import Any

import attrs
import torch

from unified_attn.backend import (
    AttentionBackend,
    AttentionType,
    CommonAttentionMetadata,
    LayerConfig,
)
from unified_attn.backends.kv_quant import FP8KVBackend, kv_cache_dtype_reasons, step_writes_keys
from unified_attn.backends.reference_math import (
    INVARIANT_MIN_ROWS,
    attend,
    attend_batch,
    attention_mask,
    read_cache,
    write_cache,
)
from unified_attn.selector import SelectorConfig, register_backend


@attrs.frozen
class GroupIndex:
    """Where one KV-cache group's layers write and read in a step (device tensors)."""

    write_rows: torch.Tensor  # [W] token rows that have a slot
    write_blocks: torch.Tensor  # [W] block id of each
    write_offsets: torch.Tensor  # [W] offset inside that block
    decode_blocks: torch.Tensor  # [Bd, S] block id of key position s of each decode row
    decode_offsets: torch.Tensor  # [S] offset of key position s
    # prefill row index -> (block id [S_i], offset [S_i]) of each of its key positions
    prefill_keys: dict[int, tuple[torch.Tensor, torch.Tensor]]


@attrs.frozen
class CrossIndex:
    """Where one cross-attention group's layers write the encoder keys and read them."""

    write_rows: torch.Tensor  # device [W] key rows (encoder tokens) that have a slot
    write_blocks: torch.Tensor  # device [W] block id of each
    write_offsets: torch.Tensor  # device [W] offset inside that block
    # request index -> (block id [S_i], offset [S_i]) of its encoder positions 0..S_i-1
    keys: dict[int, tuple[torch.Tensor, torch.Tensor]]


@attrs.frozen
class ReferencePlan:
    """The reference backend's step: decode rows (one query token) in one padded batch, the
    other rows one by one (all of them in batch-invariant mode)."""

    query_ranges: list[tuple[int, int]]  # host: token rows of each request
    computed: list[int]  # host: tokens of each request already in the cache
    prefill_rows: list[int]  # host: requests attended one by one (all but the decode batch)
    decode_tokens: torch.Tensor  # device [Bd] int64: token row of each decode request
    decode_pos: torch.Tensor  # device [Bd]: position of that token
    decode_valid: torch.Tensor  # device [Bd, S] bool: key positions each decode row may read
    groups: dict[int, GroupIndex]  # KV-cache group id -> its indices (decoder layers)
    cross: dict[int, CrossIndex] = attrs.Factory(dict)  # the same, cross-attention layers


@register_backend(priority={"cpu": 100, "cuda": 10})
class ReferenceAttentionBackend(FP8KVBackend[ReferencePlan], AttentionBackend[ReferencePlan]):
    name = "reference"

    @classmethod
    def validate_configuration(cls, cfg: SelectorConfig) -> list[str]:
        return kv_cache_dtype_reasons(cls.name, cfg)

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True  # each request is computed on its own

    def prep_forward(
        self,
        common: CommonAttentionMetadata,
        block_tables: dict[int, torch.Tensor],
        for_cudagraph_capture: bool = False,
    ) -> None:
        num_reqs = common.num_reqs
        qsl, seq_lens, computed = common.host_lists()
        query_ranges = list(itertools.pairwise(qsl))
        # Decode rows share one batch padded to the longest; in batch-invariant mode every
        # request is attended on its own (the padding would change the reduction's shape).
        decode = [
            i for i, (a, b) in enumerate(query_ranges) if b - a == 1 and not self.batch_invariant
        ]
        device = common.positions.device
        decode_pos = torch.tensor([seq_lens[i] - 1 for i in decode], device=device)
        max_len = max((seq_lens[i] for i in decode), default=0)
        batched = set(decode)
        prefill_rows = [i for i in range(num_reqs) if i not in batched]
        gids = set(self.group_of_layer.values())
        cross = self.attn_type == AttentionType.ENCODER_DECODER
        self.plan = ReferencePlan(
            query_ranges=query_ranges,
            computed=computed,
            prefill_rows=prefill_rows,
            decode_tokens=torch.tensor([qsl[i] for i in decode], dtype=torch.long, device=device),
            decode_pos=decode_pos,
            decode_valid=torch.arange(max_len, device=device) < decode_pos[:, None] + 1,
            groups={
                gid: self._group_index(
                    common, gid, block_tables[gid], decode, prefill_rows, seq_lens, max_len
                )
                for gid in gids
                if not cross
            },
            cross={gid: self._cross_index(common, gid, block_tables[gid]) for gid in gids if cross},
        )
        if self.kv_scales is not None:  # fp8 cache: calibrate the layers in this step?
            writes = step_writes_keys(common, gids, cross)
            self.kv_scales.begin_step(writes, for_cudagraph_capture)

    def _cross_index(
        self, common: CommonAttentionMetadata, gid: int, block_table: torch.Tensor
    ) -> CrossIndex:
        if common.encoder_seq_lens_cpu is None:
            raise ValueError(
                f"{self.name}: cross-attention layers need common.encoder_seq_lens_cpu (the "
                "encoder length of each request); the runner sets it for encoder-decoder models"
            )
        device = common.positions.device
        bs = self._block_size(gid)
        slots = common.slot_mappings[gid].cpu()
        rows = torch.nonzero(slots >= 0).flatten()
        table = block_table.cpu().long()
        keys = {}
        for i, length in enumerate(common.encoder_seq_lens_cpu.tolist()[: common.num_reqs]):
            pos = torch.arange(length)
            keys[i] = (table[i, pos // bs].to(device), (pos % bs).to(device))
        return CrossIndex(
            write_rows=rows.to(device),
            write_blocks=(slots[rows] // bs).to(device),
            write_offsets=(slots[rows] % bs).to(device),
            keys=keys,
        )

    def _group_index(
        self,
        common: CommonAttentionMetadata,
        gid: int,
        block_table: torch.Tensor,
        decode: list[int],
        prefill_rows: list[int],
        seq_lens: list[int],
        max_len: int,
    ) -> GroupIndex:
        device = common.positions.device
        bs = self._block_size(gid)
        slots = common.slot_mappings[gid][: common.num_actual_tokens].cpu()
        rows = torch.nonzero(slots >= 0).flatten()
        table = block_table.cpu().long()
        pos = torch.arange(max_len)
        prefill_keys = {}
        for i in prefill_rows:
            pos_i = torch.arange(seq_lens[i])
            prefill_keys[i] = (table[i, pos_i // bs].to(device), (pos_i % bs).to(device))
        return GroupIndex(
            write_rows=rows.to(device),
            write_blocks=(slots[rows] // bs).to(device),
            write_offsets=(slots[rows] % bs).to(device),
            decode_blocks=table[decode][:, pos // bs].to(device),
            decode_offsets=(pos % bs).to(device),
            prefill_keys=prefill_keys,
        )

    def _block_size(self, gid: int) -> int:
        """Tokens per block of group `gid`, read off a bound cache view."""
        for name, group in self.group_of_layer.items():
            if group == gid:
                return self.kv_caches[name].shape[2]
        raise KeyError(f"no layer of this backend is in KV-cache group {gid}")

    def forward(
        self,
        layer: LayerConfig,
        output: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor:
        q, k, v = self.check_forward_inputs(layer, output, query, key, value)
        plan = self.current_plan()
        sinks, alibi = kwargs.get("sinks"), kwargs.get("alibi_slopes")
        out = output.view(q.shape)
        if layer.attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY):
            for start, end in plan.query_ranges:
                out[start:end] = attend(
                    layer, q[start:end], k[start:end], v[start:end], 0, sinks, alibi
                )
            return output
        scales = kwargs.get("kv_scales")
        if layer.attn_type == AttentionType.ENCODER_DECODER:
            return self._cross_attention(layer, output, q, k, v, plan, scales)
        index = plan.groups[self.group_of_layer[layer.name]]
        cache = self.kv_caches[layer.name]  # [num_blocks, 2, block_size, Hkv, D]
        rows = index.write_rows
        scales = self._layer_scales(layer, scales, k[rows], v[rows])
        write_cache(cache, index.write_blocks, index.write_offsets, k[rows], v[rows], scales)
        if len(plan.decode_tokens):
            blocks, offsets = index.decode_blocks, index.decode_offsets  # [Bd, S], [S]
            out[plan.decode_tokens] = attend_batch(
                layer,
                q[plan.decode_tokens][:, None],
                read_cache(cache, blocks, offsets, 0, scales),
                read_cache(cache, blocks, offsets, 1, scales),
                plan.decode_pos[:, None],
                plan.decode_valid,
                sinks,
                alibi,
                self.num_sink_tokens,
            )[:, 0]
        min_rows = INVARIANT_MIN_ROWS if self.batch_invariant else 1
        for i in plan.prefill_rows:
            start, end = plan.query_ranges[i]
            blocks, offsets = index.prefill_keys[i]
            out[start:end] = attend(
                layer,
                q[start:end],
                read_cache(cache, blocks, offsets, 0, scales),  # [S, Hkv, D]
                read_cache(cache, blocks, offsets, 1, scales),
                plan.computed[i],
                sinks,
                alibi,
                self.num_sink_tokens,
                min_rows,
            )
        return output

    def _cross_attention(
        self,
        layer: LayerConfig,
        output: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: ReferencePlan,
        given_scales: torch.Tensor | None,
    ) -> torch.Tensor:
        """Write the encoder keys of this step, then every request's queries attend over all
        of its encoder keys (no mask)."""
        index = plan.cross[self.group_of_layer[layer.name]]
        cache = self.kv_caches[layer.name]
        rows = index.write_rows
        scales = self._layer_scales(layer, given_scales, k[rows], v[rows])
        write_cache(cache, index.write_blocks, index.write_offsets, k[rows], v[rows], scales)
        out = output.view(q.shape)
        for i, (start, end) in enumerate(plan.query_ranges):
            blocks, offsets = index.keys[i]
            keys = read_cache(cache, blocks, offsets, 0, scales)
            values = read_cache(cache, blocks, offsets, 1, scales)
            out[start:end] = attend(layer, q[start:end], keys, values, 0)
        return output


__all__ = [
    "ReferenceAttentionBackend",
    "ReferencePlan",
    "attend",
    "attend_batch",
    "attention_mask",
    "read_cache",
    "write_cache",
]
