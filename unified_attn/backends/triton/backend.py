"""`TritonAttentionBackend`: the unified contract over the Triton paged-attention kernels."""

from __future__ import annotations

from typing import Any

import attrs
import torch
import triton

from unified_attn.backend import (
    AttentionBackend,
    AttentionType,
    CommonAttentionMetadata,
    LayerConfig,
)
from unified_attn.backends.triton.ops import (
    MAX_SEGMENTS,
    SUPPORTED_DTYPES,
    SplitPlan,
    SplitScratch,
    interpreter_on,
    plan_split,
    unified_attention,
    write_kv_cache,
)
from unified_attn.selector import SelectorConfig, register_backend

MAX_HEAD_SIZE = 256


@attrs.frozen
class TritonPlan:
    """What one step's launches read. Under CUDA graphs `common` and `block_tables` are views
    of the runner's persistent buffers."""

    common: CommonAttentionMetadata  # host sizes and device index tensors of the batch
    block_tables: dict[int, torch.Tensor]  # device: group id -> [B, max_blocks] int32
    split: SplitPlan | None  # host: split-KV segments for decode batches, or None


@register_backend(priority={"cuda": 100, "cpu": 1})
class TritonAttentionBackend(AttentionBackend[TritonPlan]):
    name = "triton"

    @classmethod
    def validate_configuration(cls, cfg: SelectorConfig) -> list[str]:
        reasons = []
        device = torch.device(cfg.device).type
        if device != "cuda" and not (device == "cpu" and interpreter_on()):
            reasons.append(f"needs a CUDA device (or TRITON_INTERPRET=1 on CPU), got {device}")
        if cfg.dtype not in SUPPORTED_DTYPES:
            reasons.append(f"dtype {cfg.dtype} is not one of {SUPPORTED_DTYPES}")
        if cfg.kv_cache_dtype not in ("auto", cfg.dtype):
            reasons.append(f"KV-cache dtype {cfg.kv_cache_dtype} must equal the model dtype")
        if not 16 <= cfg.head_size <= MAX_HEAD_SIZE or cfg.head_size % 16:
            reasons.append(f"head size {cfg.head_size} is not a multiple of 16 in [16, 256]")
        if cfg.attn_type not in (AttentionType.DECODER,):
            reasons.append(f"attention type {cfg.attn_type.value} is not supported")
        return reasons

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True

    @classmethod
    def supports_cuda_graphs(cls) -> bool:
        return True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_num_heads = self.num_kv_heads
        # Split-KV partial results: persistent, grown by prep_forward, never shrunk.
        self.scratch = SplitScratch()

    def check_layer(self, layer: LayerConfig) -> None:
        super().check_layer(layer)
        # Planning sees every layer: remember the widest one for the split-KV scratch.
        self.max_num_heads = max(self.max_num_heads, layer.num_heads)

    def prep_forward(
        self,
        common: CommonAttentionMetadata,
        block_tables: dict[int, torch.Tensor],
        for_cudagraph_capture: bool = False,
    ) -> None:
        split = self.plan_split(common)
        self.plan = TritonPlan(common, block_tables, split)
        head_pad = max(16, triton.next_power_of_2(self.head_size))
        rows = common.num_actual_tokens * self.max_num_heads
        if for_cudagraph_capture:
            # A captured graph keeps the scratch's address: size it for any later decode step.
            self.scratch.ensure(rows, MAX_SEGMENTS, head_pad, common.positions.device)
        elif split is not None:
            self.scratch.ensure(rows, split.num_segments, head_pad, common.positions.device)

    def plan_split(self, common: CommonAttentionMetadata) -> SplitPlan | None:
        """Split-KV for decode batches that would under-fill the GPU. In batch-invariant mode
        never: a request is then one segment of its own length, whatever the batch."""
        if self.batch_invariant:
            return None
        return plan_split(
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
            num_reqs=common.num_reqs,
            num_kv_heads=self.num_kv_heads,
            device=common.positions.device,
        )

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
        common = plan.common
        gid = self.group_of_layer[layer.name]
        cache = self.kv_caches[layer.name]  # [num_blocks, 2, block_size, Hkv, D]
        k_cache, v_cache = cache[:, 0], cache[:, 1]
        num_tokens = common.num_actual_tokens
        write_kv_cache(k, v, k_cache, v_cache, common.slot_mappings[gid][:num_tokens])
        sinks = kwargs.get("sinks")
        unified_attention(
            q[:num_tokens],
            k_cache,
            v_cache,
            output.view(q.shape)[:num_tokens],
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_table=plan.block_tables[gid],
            num_seqs=common.num_reqs,
            max_query_len=common.max_query_len,
            scale=layer.scale,
            causal=layer.causal,
            window=layer.sliding_window,
            chunk=layer.chunk_size,
            soft_cap=layer.logits_soft_cap,
            sinks=None if sinks is None else sinks.float(),
            alibi_slopes=kwargs.get("alibi_slopes"),
            sink_tokens=self.num_sink_tokens,
            split=plan.split,
            scratch=self.scratch,
            batch_invariant=self.batch_invariant,
        )
        return output
