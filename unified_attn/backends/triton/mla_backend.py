"""`TritonMLABackend`: DeepSeek MLA on the Triton kernels of `mla_ops`.

The reference MLA backend (`backends/mla.py`) with its two seams replaced: the cache write is
`write_latent_cache` and every row, decode and prefill alike, goes through the weight-absorbed
paged kernel `mla_attention` in one launch per layer (`absorb_prefill`). `prep_forward` plans
the launch on the host (tiles, split-KV) and sizes the split scratch once; under CUDA-graph
capture the plan covers `max_model_len` (the runner's capture metadata) and the scratch the
most segments, so replays of shorter or longer contexts stay correct.

No sliding window (the kernel has none) and no batch invariance is claimed: the split-KV plan
and the tiles follow the batch's shape. An fp8 latent cache (`kv_cache_dtype="fp8"`, the scales
of `backends/kv_quant.py`) is dequantized by the kernels (mla_ops.py).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from unified_attn.backend import CommonAttentionMetadata, LayerConfig
from unified_attn.backends.mla import MLAReferenceBackend
from unified_attn.backends.triton.mla_ops import MLAScratch, mla_attention, write_latent_cache
from unified_attn.backends.triton.mla_plan import MAX_SEGMENTS, plan_mla
from unified_attn.backends.triton.ops import platform_reasons
from unified_attn.selector import SelectorConfig, register_backend


def _power_of_two_at_least_16(n: int) -> bool:
    return n >= 16 and not n & (n - 1)


@register_backend(priority={"cuda": 100, "cpu": 1})
class TritonMLABackend(MLAReferenceBackend):
    name = "triton-mla"
    absorb_prefill: ClassVar[bool] = True

    @classmethod
    def validate_configuration(cls, cfg: SelectorConfig) -> list[str]:
        reasons = super().validate_configuration(cfg)
        reasons += platform_reasons(cfg.device, cfg.dtype)
        if cfg.sliding_window is not None:
            reasons.append("sliding windows are not supported by the MLA kernel")
        if cfg.use_batch_invariant:
            reasons.append("batch invariance is not supported (split-KV follows the batch)")
        return reasons

    @classmethod
    def supports_cuda_graphs(cls) -> bool:
        return True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        rope = self.head_size - self.kv_lora_rank
        if not (_power_of_two_at_least_16(self.kv_lora_rank) and _power_of_two_at_least_16(rope)):
            raise ValueError(
                f"{type(self).__name__}: kv_lora_rank={self.kv_lora_rank} and "
                f"qk_rope_head_dim={rope} must be powers of two >= 16 for the MLA kernel; use "
                "the mla-reference backend for this model"
            )
        if self.sliding_window is not None:
            raise ValueError(
                f"{type(self).__name__}: sliding_window={self.sliding_window}: the MLA kernel "
                "takes no window; use the mla-reference backend"
            )
        self.max_num_heads = 1
        self.scratch = MLAScratch()  # split-KV partial results: grown on the host, never shrunk

    @classmethod
    def preferred_kernel_block_size(cls) -> int | None:
        """64: on Hopper the warp-specialized decode kernel needs pages of a multiple of 64 keys
        (a 64-key tile is one TMA copy of one page; 2.15 against 1.65 TB/s for the kernel that
        takes any page, H100, 128 heads); elsewhere the portable kernel's 64-key tiles then stay
        inside a page (one block-table load per tile). Any size is still accepted."""
        return 64

    def check_layer(self, layer: LayerConfig) -> None:
        super().check_layer(layer)
        self.max_num_heads = max(self.max_num_heads, layer.num_heads)

    def launch_plan(self, common: CommonAttentionMetadata, for_cudagraph_capture: bool) -> Any:
        device = common.positions.device
        plan = plan_mla(
            num_reqs=common.num_reqs,
            num_tokens=common.num_actual_tokens,
            num_heads=self.max_num_heads,
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
            dtype=self.dtype,
            device=device,
            latent_dims=(self.kv_lora_rank, self.head_size - self.kv_lora_rank),
            fp8_cache=self.kv_scales is not None,
        )
        if for_cudagraph_capture:  # a graph keeps the scratch's address: size it for any replay
            segments = MAX_SEGMENTS
        else:
            segments = plan.split.num_segments if plan.split is not None else 0
        if segments:
            self.scratch.ensure(
                common.num_actual_tokens, self.max_num_heads, segments, self.kv_lora_rank, device
            )
        return plan

    def write_latent(
        self, latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        write_latent_cache(latent, cache, slot_mapping)

    def absorbed_attention(
        self,
        q_abs: torch.Tensor,
        cache: torch.Tensor,
        block_table: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        *,
        kv_scale: torch.Tensor | None = None,
    ) -> None:
        mla_attention(
            q_abs, cache, block_table, query_start_loc, seq_lens, scale, out, self.kv_lora_rank,
            plan=self.current_plan().launch, scratch=self.scratch, kv_scale=kv_scale,
        )  # fmt: skip
