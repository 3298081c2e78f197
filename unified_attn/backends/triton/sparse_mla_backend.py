"""DeepSeek-V3.2 on the Triton kernels: the lightning indexer's scores run `indexer_scores` (no
`[T, S, D]` keys gathered; each token's work stops at its own earlier keys), and the sparse
attention over the selected latents runs `gathered_attention` where the latent width is one the
kernel takes (a power of two >= 16). DeepSeek-V3.2's own latent is 512 + 64 = 576 values, not
such a width: there the attention stays the reference's torch gather (`attend_rows`). Caches,
managers, plans, writes and the top-k are the reference backends' (`backends/sparse_mla.py`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from unified_attn.backend import AttentionBackend
from unified_attn.backends.deepseek_v4_steps import attend_rows
from unified_attn.backends.sparse_mla import DeepseekV32IndexerBackend, SparseMLABackend
from unified_attn.backends.triton.indexer_ops import indexer_scores
from unified_attn.backends.triton.ops import platform_reasons
from unified_attn.backends.triton.v4_ops import gathered_attention
from unified_attn.selector import SelectorConfig, register_backend


def kernel_width(width: int) -> bool:
    """Whether the gathering kernels take rows of `width` values."""
    return width >= 16 and width & (width - 1) == 0


def sparse_mla_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """`attend_rows`' contract (absorbed queries `[T, H, L + R]` over each token's latent rows):
    `gathered_attention` at a kernel width, the torch reference otherwise (decided on shapes:
    no host sync)."""
    attend = gathered_attention if kernel_width(q.shape[-1]) else attend_rows
    attend(q, cache, blocks, offsets, visible, scale, out, lse)


class TritonDeepseekV32IndexerBackend(DeepseekV32IndexerBackend):
    """The indexer's keys, scored by `indexer_scores`."""

    name = "triton-deepseek-v3.2-indexer"
    score_entries = staticmethod(indexer_scores)


@register_backend(priority={"cuda": 100})
class TritonSparseMLABackend(SparseMLABackend):
    """The latent cache user with `sparse_mla_attention`, and the Triton indexer as the
    layer's `indexer` user."""

    name = "triton-deepseek-v3.2"
    attend_rows = staticmethod(sparse_mla_attention)

    @classmethod
    def cache_user_classes(cls) -> Mapping[str, type[AttentionBackend]]:
        return {"indexer": TritonDeepseekV32IndexerBackend}

    @classmethod
    def validate_configuration(cls, cfg: SelectorConfig) -> list[str]:
        return super().validate_configuration(cfg) + platform_reasons(cfg.device, cfg.dtype)


__all__ = ["TritonDeepseekV32IndexerBackend", "TritonSparseMLABackend", "sparse_mla_attention"]
