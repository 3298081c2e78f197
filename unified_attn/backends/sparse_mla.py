"""DeepSeek-V3.2 (DeepSeek Sparse Attention) through the unified contract: multi-head latent
attention whose queries attend only to the keys a lightning indexer selects. The reference
(plain torch) backends, layer kind `"deepseek_v32"`.

**Cache users.** A V3.2 attention layer keeps two caches, each its own cache user (the contract's
"Layers with several cache users", `backend/cache_users.py`), both one row per token under the
full-attention manager, so they group, hash, hit the prefix cache and are preempted like any
full-attention layer:

- `model.layers.i.self_attn` (`SparseMLABackend`, the selected class): the MLA latent
  `[c_kv, k_pe]` of every token, `LatentKVSpec(kv_lora_rank + qk_rope_head_dim)`, as
  DeepSeek-V3 (`backends/mla.py` states the latent and the projections);
- `model.layers.i.self_attn.indexer` (`DeepseekV32IndexerBackend`, the class the main one names
  in `cache_user_classes()["indexer"]`): the indexer's key of every token,
  `LatentKVSpec(index_head_dim)`.

Both are DeepSeek-V4's compressed-cache users at a compression rate of 1 (one entry per token,
entry e = position e): the plans, cache writes, row gathering, the indexer's scores
(`index_scores`) and its top-k (`top_entries`: ties broken toward the earlier key) are V4's.

**One step of a layer.**

1. `indexer.forward(layer, topk [T, index_topk] int64, q_idx [T, Hi, Di], k_idx [T, Di],
   k_idx, weights=[T, Hi] float32)`: write the step's indexer keys, score every earlier key of
   the request (`sum_h weights[t, h] * relu(q[t, h] . k[s]) * scale`) and fill the positions of
   the best `index_topk` per query (-1 where fewer exist).
2. `main.forward(layer, output [T, H * V], query [T, H, N + R], latent [T, L + R], latent,
   kv_b_proj=..., topk=...)`: MLA's contract plus `topk` (None: every earlier key). The latent
   is written, the query absorbed (`q_abs = [q_nope @ W_UK, q_pe]`), and `q_abs` attends over
   the selected latents alone (shared-KV attention: the latent is key and value; `attend_rows`,
   the seam a kernel backend replaces); the first L features of that output, projected by
   W_UV, are the heads' values. A query at position p sees keys 0..p that the indexer picked,
   as transformers' eager `DeepseekV32Attention` (causal mask and top-k mask) does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from unified_attn.backend import (
    AttentionBackend,
    AttentionType,
    CacheConfig,
    LayerConfig,
    refuse_soft_cap,
    soft_cap_reasons,
)
from unified_attn.backends.deepseek_v4_compressed import (
    CompressedAttentionBackend,
    LightningIndexerBackend,
)
from unified_attn.backends.mla_checks import check_mla_tensor, row_size
from unified_attn.backends.mla_math import absorb_query, project_latent_out
from unified_attn.managers import FullAttentionManager
from unified_attn.selector import SelectorConfig, register_backend
from unified_attn.tensor_specs import LatentKVSpec

LAYER_KIND = "deepseek_v32"


class DeepseekV32IndexerBackend(LightningIndexerBackend):
    """The `indexer` cache user: one indexer key of `head_size` (`index_head_dim`) per token,
    the scores of every earlier key and the top `index_topk` per query (`forward`)."""

    name = "deepseek-v3.2-indexer"
    layer_kinds = (LAYER_KIND,)

    def __init__(self, *, num_kv_heads: int = 1, **kwargs: Any) -> None:
        super().__init__(compress_rate=1, num_kv_heads=num_kv_heads, **kwargs)

    def get_cache_config(self) -> CacheConfig:
        spec = LatentKVSpec(self.head_size, self.kv_cache_dtype)
        return FullAttentionManager, FullAttentionManager.Config(), spec


@register_backend(priority={"cpu": 100, "cuda": 10})
class SparseMLABackend(CompressedAttentionBackend):
    """The main cache user of a V3.2 layer: the MLA latent of every token and the attention of
    each query over the latents its indexer selected (absorbed, in float32)."""

    name = "deepseek-v3.2-reference"
    layer_kinds = (LAYER_KIND,)

    def __init__(self, *, kv_lora_rank: int, num_kv_heads: int = 1, **kwargs: Any) -> None:
        super().__init__(compress_rate=1, num_kv_heads=num_kv_heads, **kwargs)
        if not isinstance(kv_lora_rank, int) or not 0 < kv_lora_rank < self.head_size:
            raise ValueError(
                f"{type(self).__name__}: kv_lora_rank={kv_lora_rank!r}, expected an int in "
                f"(0, head_size={self.head_size}) (head_size = kv_lora_rank + qk_rope_head_dim)"
            )
        self.kv_lora_rank = kv_lora_rank

    @classmethod
    def cache_user_classes(cls) -> Mapping[str, type[AttentionBackend]]:
        return {"indexer": DeepseekV32IndexerBackend}

    @classmethod
    def validate_configuration(cls, cfg: SelectorConfig) -> list[str]:
        reasons = []
        if cfg.kv_cache_dtype not in ("auto", cfg.dtype):
            reasons.append(f"KV-cache dtype {cfg.kv_cache_dtype} must equal the model dtype")
        if cfg.attn_type != AttentionType.DECODER:
            reasons.append(f"V3.2 layers are causal decoder layers, not {cfg.attn_type.value}")
        if cfg.sliding_window is not None or cfg.attention_chunk_size is not None:
            reasons.append("V3.2 layers take no sliding window and no attention chunks")
        if cfg.has_sinks or cfg.num_sink_tokens:
            reasons.append("V3.2 layers take no sinks")
        return reasons + soft_cap_reasons(cfg)

    def get_cache_config(self) -> CacheConfig:
        spec = LatentKVSpec(self.head_size, self.kv_cache_dtype)
        return FullAttentionManager, FullAttentionManager.Config(), spec

    def check_layer(self, layer: LayerConfig) -> None:
        super().check_layer(layer)
        refuse_soft_cap(layer, "DeepSeek-V3.2 backends")

    def forward(
        self,
        layer: LayerConfig,
        output: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor:
        """MLA's forward (`backends/mla.py`) restricted to `topk [T, k]` (int64 keyword, the
        positions each query may see, -1 = none; absent: every earlier key)."""
        q, latent, out, w_uk, w_uv = self._views(
            layer, output, query, key, value, kwargs.get("kv_b_proj")
        )
        q_abs = absorb_query(q, w_uk)  # [T, H, L + R]
        rows = self.gather_rows(layer, q_abs, latent, kwargs.get("topk"))
        attended = torch.empty_like(q_abs)
        lse = torch.empty(q_abs.shape[:2], dtype=torch.float32, device=q_abs.device)
        self.attend_rows(q_abs, rows.cache, rows.blocks, rows.offsets, rows.visible,
                         layer.scale, attended, lse)  # fmt: skip
        project_latent_out(attended[..., : self.kv_lora_rank], w_uv, out)
        return output

    def _views(
        self,
        layer: LayerConfig,
        output: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_b_proj: torch.Tensor | None,
    ) -> tuple[torch.Tensor, ...]:
        """Check the inputs; q `[T, H, N + R]`, latent `[T, L + R]`, out `[T, H, V]`, W_UK
        `[H, N, L]` and W_UV `[H, L, V]` (views, no copies)."""
        if kv_b_proj is None:
            raise ValueError(
                f"layer {layer.name}: forward needs the keyword argument kv_b_proj (the layer's "
                "kv_b_proj.weight [H * (qk_nope_head_dim + v_head_dim), kv_lora_rank])"
            )
        tokens, heads = query.shape[0], layer.num_heads
        width, rank = self.head_size, self.kv_lora_rank
        q_dim, v_dim = row_size(query) // heads, row_size(output) // heads
        nope = q_dim - (width - rank)
        if nope <= 0 or v_dim == 0:
            raise ValueError(
                f"layer {layer.name}: query has {q_dim} values per head and output {v_dim}; "
                f"expected qk_nope_head_dim + {width - rank} (qk_rope_head_dim) with "
                "qk_nope_head_dim > 0, and v_head_dim > 0"
            )
        expected = {
            "query": (query, (tokens, heads * q_dim)),
            "key": (key, (tokens, width)),
            "value": (value, (tokens, width)),
            "output": (output, (tokens, heads * v_dim)),
            "kv_b_proj": (kv_b_proj, (heads * (nope + v_dim), rank)),
        }
        for what, (tensor, shape) in expected.items():
            check_mla_tensor(layer, what, tensor, shape, self.dtype, query.device)
        w = kv_b_proj.view(heads, nope + v_dim, rank)
        return (
            query.view(tokens, heads, q_dim),
            key.view(tokens, width),
            output.view(tokens, heads, v_dim),
            w[:, :nope],
            w[:, nope:].transpose(1, 2),
        )


__all__ = ["DeepseekV32IndexerBackend", "SparseMLABackend"]
