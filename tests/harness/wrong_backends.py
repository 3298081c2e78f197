"""Deliberately wrong native backends: the migration harness and the conformance suite must
catch both. Reached as `tests.harness.wrong_backends:WrongScaleBackend` (never registered)."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from unified_attn.backend import AttentionType, CommonAttentionMetadata, LayerConfig
from unified_attn.backends.reference import ReferenceAttentionBackend, attend


class WrongScaleBackend(ReferenceAttentionBackend):
    """Scales scores by 1.25 / sqrt(D) instead of the layer's scale."""

    name = "wrong-scale"

    def forward(
        self,
        layer: LayerConfig,
        output: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor:
        wrong = attrs.evolve(layer, scale=layer.scale * 1.25)
        return super().forward(wrong, output, query, key, value, **kwargs)


class IgnoresWindowBackend(ReferenceAttentionBackend):
    """Attends to every cached key of a sliding-window layer (the window is never applied)."""

    name = "ignores-window"

    def forward(
        self,
        layer: LayerConfig,
        output: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor:
        unwindowed = attrs.evolve(layer, sliding_window=None)
        return super().forward(unwindowed, output, query, key, value, **kwargs)


class CausalEncoderBackend(ReferenceAttentionBackend):
    """Masks encoder and encoder-only layers causally (they attend both ways)."""

    name = "causal-encoder"

    def forward(
        self,
        layer: LayerConfig,
        output: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor:
        if layer.attn_type not in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY):
            return super().forward(layer, output, query, key, value, **kwargs)
        q, k, v = self.check_forward_inputs(layer, output, query, key, value)
        causal = attrs.evolve(layer, attn_type=AttentionType.DECODER)
        out = output.view(q.shape)
        for start, end in self.current_plan().query_ranges:
            out[start:end] = attend(causal, q[start:end], k[start:end], v[start:end], 0)
        return output


class CrossIgnoresSlotMappingBackend(ReferenceAttentionBackend):
    """Writes a step's encoder rows to slots 0, 1, 2, ... (as if the cross cache were one flat
    buffer) instead of the group's slot mapping, and reads through the block table."""

    name = "cross-ignores-slot-mapping"

    def prep_forward(
        self,
        common: CommonAttentionMetadata,
        block_tables: dict[int, torch.Tensor],
        for_cudagraph_capture: bool = False,
    ) -> None:
        super().prep_forward(common, block_tables, for_cudagraph_capture)
        plan = self.current_plan()
        cross = {}
        for gid, index in plan.cross.items():
            flat = torch.arange(len(index.write_rows), device=index.write_rows.device)
            size = self._block_size(gid)
            cross[gid] = attrs.evolve(index, write_blocks=flat // size, write_offsets=flat % size)
        self.plan = attrs.evolve(plan, cross=cross)


class CrossReadsFirstBlockBackend(ReferenceAttentionBackend):
    """Reads only the first cache block of each request's encoder keys."""

    name = "cross-reads-first-block"

    def prep_forward(
        self,
        common: CommonAttentionMetadata,
        block_tables: dict[int, torch.Tensor],
        for_cudagraph_capture: bool = False,
    ) -> None:
        super().prep_forward(common, block_tables, for_cudagraph_capture)
        plan = self.current_plan()
        cross = {}
        for gid, index in plan.cross.items():
            size = self._block_size(gid)
            keys = {i: (b[:size], o[:size]) for i, (b, o) in index.keys.items()}
            cross[gid] = attrs.evolve(index, keys=keys)
        self.plan = attrs.evolve(plan, cross=cross)


class CrossAttendsStepKeysBackend(ReferenceAttentionBackend):
    """Attends over the key rows of the step, split by encoder length, and never touches the
    cache: right while every request's encoder is written in the step, wrong after (E = 0)."""

    name = "cross-attends-step-keys"

    def forward(
        self,
        layer: LayerConfig,
        output: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor:
        if layer.attn_type != AttentionType.ENCODER_DECODER:
            return super().forward(layer, output, query, key, value, **kwargs)
        q, k, v = self.check_forward_inputs(layer, output, query, key, value)
        plan = self.current_plan()
        index = plan.cross[self.group_of_layer[layer.name]]
        out, first = output.view(q.shape), 0
        for i, (start, end) in enumerate(plan.query_ranges):
            last = first + len(index.keys[i][0])
            out[start:end] = attend(layer, q[start:end], k[first:last], v[first:last], 0)
            first = last
        return output
