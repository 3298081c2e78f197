"""DeepSeek-V4 on the Triton kernels: the `swa` window and the compressed-entry attention run
`gathered_attention` (one program per token and 16 heads over the token's own rows, a partial
softmax with its log-sum-exp, as the reference backends return). The caches, managers, plans
and the other cache users (compressor, lightning indexer) are the reference backends': only
`forward`'s attention changes, so both backends fill caches the same way.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from unified_attn.backend import AttentionBackend, LayerConfig
from unified_attn.backends.deepseek_v4 import DeepseekV4WindowBackend
from unified_attn.backends.deepseek_v4_compressed import CompressedAttentionBackend
from unified_attn.backends.deepseek_v4_steps import check_tensor, write_rows
from unified_attn.backends.triton.ops import platform_reasons
from unified_attn.backends.triton.v4_ops import gathered_attention
from unified_attn.selector import SelectorConfig, register_backend


def _checked_lse(layer: LayerConfig, kwargs: dict[str, Any], n: int, device: torch.device):
    lse = kwargs.get("lse")
    if lse is None:
        raise ValueError(f"layer {layer.name}: forward needs lse=[T, H] float32")
    check_tensor(layer, "lse", lse, (n, layer.num_heads), torch.float32, device)
    return lse


class TritonCompressedAttentionBackend(CompressedAttentionBackend):
    """CSA/HCA's compressed entries through `gathered_attention`: a token's rows are the
    entries its top-k names (CSA) or every entry of its request (HCA), visible once complete."""

    name = "triton-deepseek-v4-compressed"

    def forward(
        self,
        layer: LayerConfig,
        output: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor:
        plan = self.current_plan()
        self._check_entries(layer, query, key)
        n, heads, width = plan.num_tokens, layer.num_heads, self.head_size
        check_tensor(layer, "output", output, (n, heads * width), self.dtype, query.device)
        lse = _checked_lse(layer, kwargs, n, query.device)
        index = plan.groups[self.group_of_layer[layer.name]]
        cache = self.kv_caches[layer.name]
        write_rows(cache, index.write_blocks, index.write_offsets, key)
        # read_offsets broadcasts over requests (entry e sits at the same offset in each)
        offsets = index.read_offsets.expand_as(index.read_blocks)[index.request]
        blocks = index.read_blocks[index.request]
        visible = index.visible
        topk = kwargs.get("topk")
        if topk is not None:
            check_tensor(layer, "topk", topk, (n, -1), torch.int64, query.device)
            picks = topk.clamp(0, max(plan.num_entries - 1, 0))
            named = (topk >= 0) & (topk < plan.num_entries)
            blocks, offsets = blocks.gather(1, picks), offsets.gather(1, picks)
            visible = named & visible.gather(1, picks)
        out = output.view(n, heads, width)
        gathered_attention(query, cache, blocks, offsets, visible, layer.scale, out, lse)
        return output


@register_backend(priority={"cuda": 100})
class TritonDeepseekV4Backend(DeepseekV4WindowBackend):
    """The `swa` cache user on `gathered_attention` (each token's window of latents), with the
    Triton compressed-entry attention as the layer's `compressed` user."""

    name = "triton-deepseek-v4"
    compressed_cls: ClassVar[type[AttentionBackend]] = TritonCompressedAttentionBackend

    @classmethod
    def validate_configuration(cls, cfg: SelectorConfig) -> list[str]:
        reasons = super().validate_configuration(cfg)
        reasons += platform_reasons(cfg.device, cfg.dtype)
        if cfg.head_size < 16 or cfg.head_size & (cfg.head_size - 1):
            reasons.append(f"head size {cfg.head_size} is not a power of two >= 16")
        return reasons

    def forward(
        self,
        layer: LayerConfig,
        output: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor:
        plan = self.current_plan()
        n, heads, width = plan.num_tokens, layer.num_heads, self.head_size
        device = query.device
        check_tensor(layer, "query", query, (n, heads, width), self.dtype, device)
        check_tensor(layer, "key", key, (n, width), self.dtype, device)
        check_tensor(layer, "output", output, (n, heads * width), self.dtype, device)
        lse = _checked_lse(layer, kwargs, n, device)
        index = plan.groups[self.group_of_layer[layer.name]]
        cache = self.kv_caches[layer.name]
        rows = index.write_rows
        write_rows(cache, index.write_blocks, index.write_offsets, key[rows])
        out = output.view(n, heads, width)
        gathered_attention(
            query, cache, index.key_blocks, index.key_offsets, index.key_valid, layer.scale,
            out, lse,
        )  # fmt: skip
        return output
