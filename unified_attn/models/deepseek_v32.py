"""DeepSeek-V3.2: DeepSeek-V3's multi-head latent attention and DeepSeekMoE plus DeepSeek Sparse
Attention, numerically as transformers' `DeepseekV32ForCausalLM` (eval mode).

Each layer's lightning indexer (`self_attn.indexer`) scores every earlier token for every query
and keeps the best `index_topk`; the MLA attention then attends only to those. The indexer
projects its own queries from the attention's query latent (`wq_b` on `q_a_layernorm(q_a_proj
(x))`) and one key per token (`wk`, a LayerNorm `k_norm`), rotates their first
`qk_rope_head_dim` features with RoPE in halves (`rotate_half`; the MLA part rotates
interleaved pairs, as V3), and weighs its heads by `weights_proj(x) * index_n_heads ** -0.5`:
`score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s] * index_head_dim ** -0.5)`.

Each layer has two cache users (`unified_attn.backends.sparse_mla` states the contract): the
MLA latent (`model.layers.i.self_attn`, the selected backend of layer kind `"deepseek_v32"`)
and the indexer's keys (`model.layers.i.self_attn.indexer`, the class the selected one names
for the role `"indexer"`). Parameter names are transformers' own (`load_deepseek_v32` in
`models/deepseek_v32_hf.py`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import attrs
import torch
from torch import nn

from unified_attn.backend import AttentionBackend, LayerConfig
from unified_attn.models.deepseek import (
    DeepseekForCausalLM,
    MLAAttention,
    apply_rope,
    mla_layer_config,
)
from unified_attn.models.deepseek_config import DeepseekConfig
from unified_attn.models.deepseek_moe import DeepseekMoE
from unified_attn.models.layers import RMSNorm
from unified_attn.models.mlp import MLP
from unified_attn.utils import positive_int

INDEXER_ROLE = "indexer"  # the cache user besides the latent (`cache_user_classes`)
INDEXER_NORM_EPS = 1e-6  # transformers' k_norm (a LayerNorm), whatever rms_norm_eps is


@attrs.frozen(kw_only=True)
class DeepseekV32Config(DeepseekConfig):
    """A DeepSeek-V3 config plus the lightning indexer's shape; names follow `config.json`."""

    index_topk: int = attrs.field(default=2048, validator=positive_int)
    index_head_dim: int = attrs.field(default=128, validator=positive_int)
    index_n_heads: int = attrs.field(default=64, validator=positive_int)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        found = {
            "version": (self.version, "v3"),
            "rope_layout": (self.rope_layout, "interleave"),
            "q_lora_rank": (self.q_lora_rank, "an int (the indexer reads the query latent)"),
        }
        for field, (value, expected) in found.items():
            if value is None or (field != "q_lora_rank" and value != expected):
                raise ValueError(
                    f"DeepseekV32Config {self.name}: {field}={value!r}, expected {expected}"
                )
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(
                f"DeepseekV32Config {self.name}: index_head_dim={self.index_head_dim}, expected "
                f">= qk_rope_head_dim={self.qk_rope_head_dim} (RoPE turns its first features)"
            )


class LightningIndexer(nn.Module):
    """`self_attn.indexer`: the top `index_topk` earlier positions of every query, from the
    scores the `indexer` cache user computes over its cached keys."""

    def __init__(self, config: DeepseekV32Config, user: LayerConfig, backend: AttentionBackend):
        super().__init__()
        self.layer_config, self.backend = user, backend
        heads, dim = config.index_n_heads, config.index_head_dim
        self.heads, self.dim, self.topk = heads, dim, config.index_topk
        self.rope = config.qk_rope_head_dim
        self.wq_b = nn.Linear(cast(int, config.q_lora_rank), heads * dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, dim, bias=False)
        self.k_norm = nn.LayerNorm(dim, eps=INDEXER_NORM_EPS)
        self.weights_proj = nn.Linear(config.hidden_size, heads, bias=False)  # kept float32

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE in halves on the first `qk_rope_head_dim` features of x `[T, heads, D]`."""
        turned = apply_rope(x[..., : self.rope], cos, sin, "halves")
        return torch.cat([turned, x[..., self.rope :]], dim=-1)

    def forward(
        self, hidden: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """hidden `[T, hidden_size]`, q_latent `[T, q_lora_rank]` -> the positions `[T,
        index_topk]` int64 each query attends to (-1: none)."""
        tokens = hidden.shape[0]
        q = self._rope(self.wq_b(q_latent).view(tokens, self.heads, self.dim), cos, sin)
        k = self._rope(self.k_norm(self.wk(hidden))[:, None], cos, sin)[:, 0]  # [T, D]
        weights = self.weights_proj(hidden.to(self.weights_proj.weight.dtype)).float()
        weights = weights * self.heads**-0.5  # [T, Hi]
        topk = torch.empty(tokens, self.topk, dtype=torch.int64, device=hidden.device)
        return self.backend.forward(self.layer_config, topk, q, k, k, weights=weights)


class SparseMLAAttention(MLAAttention):
    """DeepSeek-V3's MLA (q_lora_rank, interleaved RoPE) whose queries see only the positions
    the indexer picks."""

    def __init__(
        self, config: DeepseekV32Config, layer: LayerConfig, backends: dict[str, AttentionBackend]
    ) -> None:
        super().__init__(config, layer, backends["mla"])
        self.indexer = LightningIndexer(
            config, indexer_layer_config(config, layer.name), backends[INDEXER_ROLE]
        )

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """hidden `[T, hidden_size]` -> `[T, hidden_size]`."""
        assert self.q_a_proj is not None and self.q_a_layernorm is not None
        assert self.q_b_proj is not None
        nope, rope, v_dim = self.split
        tokens, heads = hidden.shape[0], self.layer_config.num_heads
        q_latent = self.q_a_layernorm(self.q_a_proj(hidden))
        q = self.q_b_proj(q_latent).view(tokens, heads, nope + rope)
        q = torch.cat([q[..., :nope], apply_rope(q[..., nope:], cos, sin, self.layout)], -1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, rope], dim=-1)
        k_pe = apply_rope(k_pe[:, None], cos, sin, self.layout)[:, 0]
        latent = torch.cat([self.kv_a_layernorm(c_kv), k_pe], dim=-1)  # [T, L + R]
        topk = self.indexer(hidden, q_latent, cos, sin)
        output = hidden.new_empty(tokens, heads * v_dim)
        self.backend.forward(self.layer_config, output, q, latent, latent,
                             kv_b_proj=self.kv_b_proj.weight, topk=topk)  # fmt: skip
        return cast(torch.Tensor, self.o_proj(output))


def indexer_layer_config(config: DeepseekV32Config, attention: str) -> LayerConfig:
    """The `indexer` cache user of the layer named `attention`: one key of `index_head_dim`
    per token, `index_n_heads` query heads, the scores' scale `index_head_dim ** -0.5`."""
    dim = config.index_head_dim
    return LayerConfig(f"{attention}.{INDEXER_ROLE}", config.index_n_heads, 1, dim, dim**-0.5)


class DeepseekV32DecoderLayer(nn.Module):
    def __init__(
        self, config: DeepseekV32Config, index: int, backends: dict[str, AttentionBackend]
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = SparseMLAAttention(config, mla_layer_config(config, index), backends)
        dense = index < config.first_k_dense_replace
        self.mlp: nn.Module = (
            MLP(hidden, config.intermediate_size, bias=config.mlp_bias)
            if dense
            else DeepseekMoE(config)
        )
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin)
        return cast(torch.Tensor, hidden + self.mlp(self.post_attention_layernorm(hidden)))


class _Backbone(nn.Module):
    """The `model.` prefix of the parameter names."""

    def __init__(self, config: DeepseekV32Config, backends: dict[str, AttentionBackend]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekV32DecoderLayer(config, i, backends) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV32ForCausalLM(DeepseekForCausalLM):
    """Inference-only DeepSeek-V3.2 (`DeepseekForCausalLM` with sparse attention layers).
    Backends: `"mla"` (the selected class, the latents) and `"indexer"` (its
    `cache_user_classes()["indexer"]`, the indexer's keys), one instance each for every layer."""

    config: DeepseekV32Config

    def _make_backends(
        self, backend_cls: type[AttentionBackend], options: dict[str, Any], device: torch.device
    ) -> dict[str, AttentionBackend]:
        indexer_cls = backend_cls.cache_user_classes().get(INDEXER_ROLE)
        if indexer_cls is None:
            raise ValueError(
                f"{backend_cls.__name__} is not a DeepSeek-V3.2 backend: it has no class for the "
                f"cache user {INDEXER_ROLE!r}; use a backend of layer kind 'deepseek_v32' (e.g. "
                "deepseek-v3.2-reference)"
            )
        backends = super()._make_backends(backend_cls, options, device)
        indexer = cast(Any, indexer_cls)(
            num_kv_heads=1, head_size=self.config.index_head_dim, dtype=self.dtype, **options
        )
        return {**backends, INDEXER_ROLE: indexer}

    def _build(self) -> None:
        self.model = _Backbone(self.config, self.backends)  # type: ignore[assignment]
        self._build_lm_head()

    def _cast(self) -> None:
        super()._cast()
        for module in self.modules():  # transformers keeps the head weights in float32
            if isinstance(module, LightningIndexer):
                module.weights_proj.float()

    def attention_layers(self) -> Iterator[tuple[LayerConfig, AttentionBackend]]:
        """Both cache users of every layer: the latent, then the indexer's keys."""
        for layer in self.model.layers:
            attn = cast(DeepseekV32DecoderLayer, layer).self_attn
            yield attn.layer_config, attn.backend
            yield attn.indexer.layer_config, attn.indexer.backend


def v32_preset(
    base: DeepseekConfig, name: str, *, index_topk: int, index_head_dim: int, index_n_heads: int
) -> DeepseekV32Config:
    """`base` (a DeepSeek-V3 config) with a lightning indexer of the given shape."""
    fields: dict[str, Any] = {f.name: getattr(base, f.name) for f in attrs.fields(DeepseekConfig)}
    return DeepseekV32Config(
        **{**fields, "name": name},
        index_topk=index_topk,
        index_head_dim=index_head_dim,
        index_n_heads=index_n_heads,
    )
