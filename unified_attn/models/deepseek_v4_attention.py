"""DeepSeek-V4's attention, numerically as transformers' `DeepseekV4ForCausalLM` (eval mode):
projections, norms and partial RoPE, the CSA/HCA compressors, the lightning indexer, the merge
of the cache users' partial softmaxes with the sinks, and the grouped output projection.

The attention layer owns several *cache users* (`CacheUser`: a `LayerConfig` named
`model.layers.i.self_attn.<user>` and its backend instance);
`unified_attn.backends.deepseek_v4_window` states what each backend takes. The layer programs
against the contract only (`backend/cache_users.py`, "Layers with several cache users"): the
`swa` user and (CSA/HCA) the `compressed` user are
`RowSource`s, each writing its rows and returning the rows every query reads; the `swa` user is
also the `RowSetAttention`, one softmax over both sets and the learned sinks, as transformers
does; the compressors are `WindowSource`s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import attrs
import torch
from torch import nn

from unified_attn.backend import (
    AttentionBackend,
    GatheredRows,
    LayerConfig,
    RowSetAttention,
    RowSource,
    WindowSource,
    as_capability,
)
from unified_attn.models.layers import RMSNorm
from unified_attn.models.rope import rope_attention_scaling, rope_inv_freq

if TYPE_CHECKING:
    from unified_attn.models.deepseek_v4 import DeepseekV4Config

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
CosSin = tuple[torch.Tensor, torch.Tensor]  # each [T, rope_dim / 2]


@attrs.frozen
class CacheUser:
    """One cache of an attention layer: its planning identity and the backend that owns it."""

    layer: LayerConfig
    backend: AttentionBackend = attrs.field(eq=False)


def v4_norm(size: int, eps: float) -> RMSNorm:
    """transformers' DeepseekV4RMSNorm: normalise and scale in float32, cast once."""
    return RMSNorm(size, eps, style="float32")


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """V4's interleaved RoPE on the trailing `2 * cos.shape[-1]` features of x `[T, ..., D]`
    (pairs `(x[2i], x[2i+1])`, rotated in float32); cos/sin `[T, R / 2]`."""
    rope_dim = 2 * cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim,)
    cos = cos.repeat_interleave(2, dim=-1).view(shape)
    sin = sin.repeat_interleave(2, dim=-1).view(shape)
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    turned = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rope.float() * cos + turned.float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


class WindowCompressor(nn.Module):
    """Pools every `rate` tokens into one entry of `head_dim`: softmax over the window of
    `gate + position_bias`, weighted sum of `kv`, `kv_norm`, RoPE at the window's first position.
    With `overlap` (CSA) projections are `2 * head_dim` wide and entry w pools window w-1's
    first half (Ca) with window w's second half (Cb). Its raw rows live in the `state` cache
    user; the pooled entries go to the caller."""

    def __init__(
        self, config: DeepseekV4Config, head_dim: int, rate: int, overlap: bool, state: CacheUser
    ) -> None:
        super().__init__()
        width = 2 * head_dim if overlap else head_dim
        self.head_dim, self.rate, self.overlap, self.state = head_dim, rate, overlap, state
        self.kv_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width))
        self.kv_norm = v4_norm(head_dim, config.rms_norm_eps)
        self.windows: WindowSource = as_capability(state.backend, WindowSource, state.layer.name)

    def forward(self, hidden: torch.Tensor, rope: Any) -> torch.Tensor:
        """hidden `[T, hidden_size]` -> entries `[N, head_dim]` of the windows closing in this
        step; `rope(positions) -> (cos, sin)` of the compressed branch."""
        kv, gate = self.kv_proj(hidden), self.gate_proj(hidden)
        count, starts = self.windows.closing_windows()
        span = 2 * self.rate if self.overlap else self.rate
        windows = kv.new_empty(count, 2, span, kv.shape[-1])
        self.state.backend.forward(self.state.layer, windows, kv, kv, gate)
        pooled = self.pool(windows[:, 0], windows[:, 1])
        cos, sin = rope(starts)
        return apply_rope(pooled, cos, sin)

    def pool(self, kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """kv, gate `[N, span, width]` (oldest row first) -> `[N, head_dim]`."""
        rate, dim = self.rate, self.head_dim
        if self.overlap:  # previous window's Ca then this window's Cb, each with its bias
            bias = self.position_bias
            kv = torch.cat([kv[:, :rate, :dim], kv[:, rate:, dim:]], dim=1)
            gate = torch.cat([gate[:, :rate, :dim] + bias[:, :dim],
                              gate[:, rate:, dim:] + bias[:, dim:]], dim=1)  # fmt: skip
        else:
            gate = gate + self.position_bias
        probs = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        return cast(torch.Tensor, self.kv_norm((kv * probs).sum(dim=1)))


class IndexerScorer(nn.Module):
    """`scorer.weights_proj`: the per-head weights of the indexer's scores."""

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(config.hidden_size, config.index_n_heads, bias=False)
        self.weights_scaling = config.index_n_heads**-0.5

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.weights_proj(hidden).float() * self.weights_scaling  # [T, Hi]


class LightningIndexer(WindowCompressor):
    """CSA's indexer: its own overlapping compressor at `index_head_dim` (cached by the
    `indexer` user), a query from `q_residual` and the top-`index_topk` entries per query."""

    def __init__(self, config: DeepseekV4Config, state: CacheUser, keys: CacheUser) -> None:
        super().__init__(config, config.index_head_dim, config.csa_compress_rate, True, state)
        self.keys, self.num_heads, self.topk = keys, config.index_n_heads, config.index_topk
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.scorer = IndexerScorer(config)

    def select(
        self, hidden: torch.Tensor, q_residual: torch.Tensor, rope: Any, cos_sin: CosSin
    ) -> torch.Tensor:
        """Top-k entry indices `[T, index_topk]` int64 (-1: none) of every query."""
        entries = super().forward(hidden, rope)
        q = self.q_b_proj(q_residual).view(hidden.shape[0], self.num_heads, self.head_dim)
        q = apply_rope(q, *cos_sin)
        topk = torch.empty(hidden.shape[0], self.topk, dtype=torch.int64, device=hidden.device)
        weights = self.scorer(hidden)
        return self.keys.backend.forward(
            self.keys.layer, topk, q, entries, entries, weights=weights
        )


class Compressor(WindowCompressor):
    """`self_attn.compressor`: CSA (overlapping windows + lightning indexer) or HCA (plain
    windows), cached by the `compressor` (raw rows) and `compressed` (entries) users."""

    indexer: LightningIndexer | None

    def __init__(self, config: DeepseekV4Config, sparse: bool, users: dict[str, CacheUser]):
        rate = config.csa_compress_rate if sparse else config.hca_compress_rate
        super().__init__(config, config.head_dim, rate, sparse, users["compressor"])
        self.entries = users["compressed"]
        self.entry_rows: RowSource = as_capability(
            self.entries.backend, RowSource, self.entries.layer.name
        )
        self.indexer = None
        if sparse:
            self.indexer = LightningIndexer(config, users["indexer_compressor"], users["indexer"])

    def rows(
        self,
        hidden: torch.Tensor,
        q: torch.Tensor,
        q_residual: torch.Tensor,
        rope: Any,
        cos_sin: CosSin,
    ) -> GatheredRows:
        """This step's entries written, and the compressed rows each query reads (CSA: those
        the indexer selects)."""
        entries = self(hidden, rope)
        topk = None
        if self.indexer is not None:
            topk = self.indexer.select(hidden, q_residual, rope, cos_sin)
        return self.entry_rows.gather_rows(self.entries.layer, q, entries, topk)


# ---- the attention layer ---------------------------------------------------------------------


class V4Rotary(nn.Module):
    """cos and sin `[T, rope_dim / 2]` of the "main" RoPE (sliding-only layers) and the
    "compress" RoPE (CSA/HCA layers, their compressors and indexer); not parameters."""

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        self.config = config
        self.reset("cpu")

    def reset(self, device: torch.device | str) -> None:
        cfg, dim = self.config, self.config.qk_rope_head_dim
        self.inv_freq = {
            "main": rope_inv_freq(dim, cfg.rope_theta, cfg.rope_scaling).to(device),
            "compress": rope_inv_freq(dim, cfg.compress_rope_theta, cfg.compress_rope_scaling)
            .to(device),
        }  # fmt: skip
        self.scaling = {
            "main": rope_attention_scaling(cfg.rope_scaling),
            "compress": rope_attention_scaling(cfg.compress_rope_scaling),
        }

    def cos_sin(self, kind: str, positions: torch.Tensor, dtype: torch.dtype) -> CosSin:
        freqs = positions[:, None].float() * self.inv_freq[kind]
        scale = self.scaling[kind]
        return (freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)


class GroupedLinear(nn.Module):
    """`o_a_proj`: each of `groups` head groups `[in]` projected on its own to `[out]`."""

    def __init__(self, in_per_group: int, out_total: int, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.zeros(out_total, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, groups, in]` -> `[T, groups, out / groups]`."""
        w = self.weight.view(self.groups, -1, x.shape[-1]).transpose(1, 2)  # [G, in, out]
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)


def cache_users(
    config: DeepseekV4Config, index: int, backends: dict[str, AttentionBackend]
) -> dict[str, CacheUser]:
    """The cache users of layer `index`: `swa` always; `compressor` + `compressed` for CSA and
    HCA; `indexer_compressor` + `indexer` for CSA."""
    prefix, kind = f"model.layers.{index}.self_attn", config.layer_types[index]
    heads, dim, scale = config.num_heads, config.head_dim, config.head_dim**-0.5
    window = config.sliding_window
    shapes: dict[str, tuple[str, int, int, float, int | None]] = {
        "swa": ("swa", heads, dim, scale, window)
    }
    if kind != SLIDING:
        tag = "csa" if kind == CSA else "hca"
        rate = config.csa_compress_rate if kind == CSA else config.hca_compress_rate
        width, span = (2 * dim, 2 * rate) if kind == CSA else (dim, rate)
        shapes["compressor"] = (f"{tag}_compressor", 1, width, 1.0, span)
        shapes["compressed"] = (f"{tag}_compressed", heads, dim, scale, None)
    if kind == CSA:
        idx, rate = config.index_head_dim, config.csa_compress_rate
        shapes["indexer_compressor"] = ("indexer_compressor", 1, 2 * idx, 1.0, 2 * rate)
        shapes["indexer"] = ("indexer", config.index_n_heads, idx, idx**-0.5, None)
    return {
        user: CacheUser(
            LayerConfig(f"{prefix}.{user}", heads_, 1, size, scale_, sliding_window=win),
            backends[key],
        )
        for user, (key, heads_, size, scale_, win) in shapes.items()
    }


class DeepseekV4Attention(nn.Module):
    """Shared-KV MQA over a sliding window plus (CSA/HCA) compressed entries, with learned
    sinks, partial interleaved RoPE on the trailing `qk_rope_head_dim` features, the inverse
    rotation of the output and the grouped output projection."""

    compressor: Compressor | None

    def __init__(
        self, config: DeepseekV4Config, index: int, backends: dict[str, AttentionBackend]
    ) -> None:
        super().__init__()
        hidden, heads, dim = config.hidden_size, config.num_heads, config.head_dim
        kind, eps, groups = config.layer_types[index], config.rms_norm_eps, config.o_groups
        self.users = cache_users(config, index, backends)
        self.rope_kind = "main" if kind == SLIDING else "compress"
        self.heads, self.dim, self.eps, self.groups = heads, dim, eps, groups
        self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=False)
        self.q_a_norm = v4_norm(config.q_lora_rank, eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, heads * dim, bias=False)
        self.kv_proj = nn.Linear(hidden, dim, bias=False)
        self.kv_norm = v4_norm(dim, eps)
        self.o_a_proj = GroupedLinear(heads * dim // groups, groups * config.o_lora_rank, groups)
        self.o_b_proj = nn.Linear(groups * config.o_lora_rank, hidden, bias=False)
        self.sinks = nn.Parameter(torch.zeros(heads))
        self.compressor = None if kind == SLIDING else Compressor(config, kind == CSA, self.users)
        swa = self.users["swa"]
        self.window_rows: RowSource = as_capability(swa.backend, RowSource, swa.layer.name)
        self.attention: RowSetAttention = as_capability(
            swa.backend, RowSetAttention, swa.layer.name
        )

    def forward(
        self, hidden: torch.Tensor, positions: torch.Tensor, rotary: V4Rotary
    ) -> torch.Tensor:
        """hidden `[T, hidden_size]` -> `[T, hidden_size]`."""
        num_tokens, dtype = hidden.shape[0], hidden.dtype
        cos, sin = rotary.cos_sin(self.rope_kind, positions, dtype)
        q_residual = self.q_a_norm(self.q_a_proj(hidden))
        q = self.q_b_proj(q_residual).view(num_tokens, self.heads, self.dim)
        q = apply_rope(unweighted_rms(q, self.eps), cos, sin)
        kv = apply_rope(self.kv_norm(self.kv_proj(hidden)), cos, sin)  # [T, D]
        swa = self.users["swa"]
        row_sets = [self.window_rows.gather_rows(swa.layer, q, kv)]
        if self.compressor is not None:

            def rope(at: torch.Tensor) -> CosSin:
                return rotary.cos_sin("compress", at, dtype)

            row_sets.append(self.compressor.rows(hidden, q, q_residual, rope, (cos, sin)))
        out = q.new_empty(num_tokens, self.heads * self.dim)
        self.attention.attend_row_sets(swa.layer, out, q, row_sets, self.sinks)
        out = apply_rope(out.view(q.shape), cos, -sin)  # undo the rotation the values carry
        grouped = self.o_a_proj(out.reshape(num_tokens, self.groups, -1)).flatten(1)
        return cast(torch.Tensor, self.o_b_proj(grouped))
