"""`TritonAttentionBackend`: the unified contract over the Triton paged-attention kernels.

Every attention type runs through the one paged kernel. Decoder layers attend causally over their
KV-cache group. Cross-attention (encoder_decoder) layers write this step's encoder keys into
their cross group, then every decoder query attends, non-causally, to all of its request's
`encoder_seq_lens` keys. Encoder and encoder-only layers keep no cache: their keys are the step's
own token rows, which the kernel reads as pages of one token through a block table that maps
key j of request i to row `query_start_loc[i] + j` (no copy).

With `kv_cache_dtype="fp8"` the caches hold float8 e4m3: the cache-write kernel quantizes with
saturation and the attention kernel dequantizes in registers, with per-layer K/V scales
(`kv_quant.KVScales`: the checkpoint's, calibrated once, or 1.0 in batch-invariant mode).
"""

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
from unified_attn.backends.kv_quant import FP8KVBackend, kv_cache_dtype_reasons, step_writes_keys
from unified_attn.backends.triton.ops import (
    SplitPlan,
    SplitScratch,
    max_split_rows,
    plan_split,
    platform_reasons,
    unified_attention,
    write_kv_cache,
)
from unified_attn.selector import SelectorConfig, register_backend

MAX_HEAD_SIZE = 256
NO_CACHE_TYPES = (AttentionType.ENCODER, AttentionType.ENCODER_ONLY)
CROSS = AttentionType.ENCODER_DECODER


@attrs.frozen
class TritonPlan:
    """What one step's launches read. Under CUDA graphs `common` and `block_tables` are views
    of the runner's persistent buffers."""

    common: CommonAttentionMetadata  # host sizes and device index tensors of the batch
    block_tables: dict[int, torch.Tensor]  # device: group id -> [B, max_blocks] int32
    split: SplitPlan | None  # host: split-KV segments for decode batches, or None
    # device [B] int32: keys of each request (seq_lens; cross-attention: encoder_seq_lens)
    key_lens: torch.Tensor
    # device [B, max_query_len] int32, encoder passes only (else None): the token row of key j
    # of request i, `query_start_loc[i] + j`; the step's own K/V are pages of one token
    own_pages: torch.Tensor | None = None


@register_backend(priority={"cuda": 100, "cpu": 1})
class TritonAttentionBackend(FP8KVBackend[TritonPlan], AttentionBackend[TritonPlan]):
    name = "triton"

    @classmethod
    def validate_configuration(cls, cfg: SelectorConfig) -> list[str]:
        reasons = platform_reasons(cfg.device, cfg.dtype)
        if torch.device(cfg.device).type == "cpu" and cfg.use_batch_invariant:
            reasons.append(
                "batch-invariant mode needs a CUDA device: the CPU interpreter computes tl.dot "
                "with numpy, whose float32 matmul rounds a row by its place in the tile"
            )
        reasons.extend(kv_cache_dtype_reasons(cls.name, cfg))
        if not 16 <= cfg.head_size <= MAX_HEAD_SIZE or cfg.head_size % 16:
            reasons.append(f"head size {cfg.head_size} is not a multiple of 16 in [16, 256]")
        if cfg.attn_type == CROSS:
            reasons.extend(cross_attention_reasons(cfg.sliding_window, cfg.attention_chunk_size))
            if cfg.has_sinks:
                reasons.append(
                    "learned attention sinks on cross-attention (encoder_decoder) layers are "
                    "not supported"
                )
        return reasons

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True

    @classmethod
    def supports_cuda_graphs(cls) -> bool:
        return True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.attn_type == CROSS:
            reasons = cross_attention_reasons(self.sliding_window, self.attention_chunk_size)
            if reasons:
                raise ValueError(f"{type(self).__name__}: {'; '.join(reasons)}")
        if self.attn_type in NO_CACHE_TYPES and self.num_sink_tokens:
            raise ValueError(
                f"{type(self).__name__}: num_sink_tokens={self.num_sink_tokens} with "
                f"attn_type={self.attn_type.value}: StreamingLLM sink tokens are a KV-cache "
                "policy and encoder layers keep no cache; build the encoder backend without them"
            )
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
        if self.attn_type in NO_CACHE_TYPES:
            self.plan = self._encoder_plan(common)
            return
        split = self.plan_split(common)
        self.plan = TritonPlan(common, block_tables, split, self._key_lens(common))
        if self.kv_scales is not None:  # fp8 cache: calibrate the layers in this step?
            gids = set(self.group_of_layer.values())
            writes = step_writes_keys(common, gids, self.attn_type == CROSS)
            self.kv_scales.begin_step(writes, for_cudagraph_capture)
        head_pad = max(16, triton.next_power_of_2(self.head_size))
        rows = common.num_actual_tokens * self.max_num_heads
        if for_cudagraph_capture:
            # A captured graph keeps the scratch's address: size it for any later decode step.
            worst = max_split_rows(self.max_num_heads, self.num_kv_heads, common.positions.device)
            self.scratch.ensure(worst, 1, head_pad, common.positions.device)
        elif split is not None:
            self.scratch.ensure(rows, split.num_segments, head_pad, common.positions.device)

    def _encoder_plan(self, common: CommonAttentionMetadata) -> TritonPlan:
        """Encoder passes: no cache, so each request's keys are its own token rows."""
        num_reqs = common.num_reqs
        query_lens = common.query_lens_cpu[:num_reqs]
        computed = common.num_computed_tokens_cpu[:num_reqs]
        if computed.any() or not torch.equal(common.seq_lens_cpu[:num_reqs], query_lens):
            raise ValueError(
                f"{self.name}: {self.attn_type.value} layers attend over each request's own "
                "tokens and keep no cache, so every request needs num_computed_tokens == 0 and "
                f"seq_lens == query lens; got num_computed_tokens={computed.tolist()}, "
                f"seq_lens={common.seq_lens_cpu[:num_reqs].tolist()}, "
                f"query lens={query_lens.tolist()} (build the batch with encoder_metadata)"
            )
        device = common.query_start_loc.device
        keys = torch.arange(common.max_query_len, dtype=torch.int32, device=device)
        own_pages = common.query_start_loc[:num_reqs, None].to(torch.int32) + keys
        return TritonPlan(common, {}, None, common.seq_lens, own_pages)

    def _key_lens(self, common: CommonAttentionMetadata) -> torch.Tensor:
        """Device [B] keys of each request: its sequence, or for cross-attention its encoder."""
        if self.attn_type != CROSS:
            return common.seq_lens
        self._encoder_lens_cpu(common)  # both are set together: fail here, not in a kernel
        assert common.encoder_seq_lens is not None
        return common.encoder_seq_lens

    def _max_key_len(self, common: CommonAttentionMetadata) -> int:
        if self.attn_type != CROSS:
            return common.max_seq_len
        lens = self._encoder_lens_cpu(common)
        return int(lens.max()) if len(lens) else 0

    def _encoder_lens_cpu(self, common: CommonAttentionMetadata) -> torch.Tensor:
        if common.encoder_seq_lens_cpu is None or common.encoder_seq_lens is None:
            raise ValueError(
                f"{self.name}: cross-attention (encoder_decoder) layers need "
                "common.encoder_seq_lens and encoder_seq_lens_cpu (each request's encoder "
                "length); the runner sets them for encoder-decoder models"
            )
        return common.encoder_seq_lens_cpu[: common.num_reqs]

    def plan_split(self, common: CommonAttentionMetadata) -> SplitPlan | None:
        """Split-KV for decode batches that would under-fill the GPU (cross-attention too: a
        decode step over long encoder outputs). In batch-invariant mode never: a request is
        then one segment of its own length, whatever the batch. Encoder passes never decode."""
        if self.batch_invariant or self.attn_type in NO_CACHE_TYPES:
            return None
        return plan_split(
            max_query_len=common.max_query_len,
            max_seq_len=self._max_key_len(common),
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
        sinks, alibi_slopes = kwargs.get("sinks"), kwargs.get("alibi_slopes")
        if layer.attn_type == CROSS and (sinks is not None or alibi_slopes is not None):
            raise ValueError(
                f"layer {layer.name}: cross-attention (encoder_decoder) layers take no sinks "
                "or alibi_slopes (every decoder query attends to all encoder keys)"
            )
        given_scales = kwargs.get("kv_scales")
        k_cache, v_cache, block_table, kv_scales = self._paged_keys(layer, plan, k, v, given_scales)
        num_tokens = common.num_actual_tokens
        unified_attention(
            q[:num_tokens],
            k_cache,
            v_cache,
            output.view(q.shape)[:num_tokens],
            query_start_loc=common.query_start_loc,
            seq_lens=plan.key_lens,
            block_table=block_table,
            num_seqs=common.num_reqs,
            max_query_len=common.max_query_len,
            scale=layer.scale,
            causal=layer.causal,
            window=layer.sliding_window,
            chunk=layer.chunk_size,
            soft_cap=layer.logits_soft_cap,
            sinks=None if sinks is None else sinks.float(),
            alibi_slopes=alibi_slopes,
            sink_tokens=self.num_sink_tokens,
            split=plan.split,
            scratch=self.scratch,
            batch_invariant=self.batch_invariant,
            kv_scales=kv_scales,
        )
        return output

    def _paged_keys(
        self,
        layer: LayerConfig,
        plan: TritonPlan,
        k: torch.Tensor,
        v: torch.Tensor,
        given_scales: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The K and V pages `[num_pages, page_size, Hkv, D]` the layer attends over, their
        block table and (fp8 caches) the `[2]` K/V scales, once this step's keys are in place."""
        if plan.own_pages is not None:  # encoder: token rows are pages of one token
            num_tokens = plan.common.num_actual_tokens
            return k[:num_tokens, None], v[:num_tokens, None], plan.own_pages, None
        gid = self.group_of_layer[layer.name]
        cache = self.kv_caches[layer.name]  # [num_blocks, 2, block_size, Hkv, D]
        k_cache, v_cache = cache[:, 0], cache[:, 1]
        slots = plan.common.slot_mappings[gid]  # cross-attention: [E], one per key row
        if layer.attn_type != CROSS:
            slots = slots[: plan.common.num_actual_tokens]
        scales = self._layer_scales(layer, given_scales, k, v, slots)
        write_kv_cache(k, v, k_cache, v_cache, slots, scales)
        return k_cache, v_cache, plan.block_tables[gid], scales


def cross_attention_reasons(window: int | None, chunk: int | None) -> list[str]:
    """Why a cross-attention configuration cannot run: every query sees every encoder key."""
    if window is None and chunk is None:
        return []
    return [
        f"cross-attention (encoder_decoder) layers attend to every encoder key: "
        f"sliding_window={window} and attention_chunk_size={chunk} on them are not supported "
        "(build the cross backend with neither)"
    ]
