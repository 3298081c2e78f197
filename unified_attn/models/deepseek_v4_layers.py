"""DeepSeek-V4's residual streams and feed-forward blocks, numerically as transformers:
manifold-constrained hyper-connections (`hc_mult` residual streams mixed by Sinkhorn-projected
weights), the final `HyperHead`, and the MoE (hash-routed `tid2eid` lookup on the first layers,
top-k routed with a correction bias on the others; clamped SwiGLU experts plus a shared one).
The routed experts are `moe.RoutedExperts` (on CUDA each expert runs only on its
tokens).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from unified_attn.backend import AttentionBackend
from unified_attn.kernels.hyper import hyper_connections as hc_kernels
from unified_attn.kernels.hyper.hyper_connections import serves_width
from unified_attn.models.deepseek_v4_attention import (
    DeepseekV4Attention,
    V4Rotary,
    unweighted_rms,
    v4_norm,
)
from unified_attn.models.moe import RoutedExperts, swiglu

if TYPE_CHECKING:
    from unified_attn.models.deepseek_v4 import DeepseekV4Config


# ---- hyper-connections -----------------------------------------------------------------------


class HyperConnection(nn.Module):
    """`attn_hc` / `ffn_hc`: from the streams `[T, N, D]`, the weights that collapse them into
    the block input (pre, consumed here), expand the block output (post) and mix the residual
    streams (comb, doubly stochastic after Sinkhorn-Knopp), all in float32."""

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        hc = config.hc_mult
        self.hc, self.iters = hc, config.hc_sinkhorn_iters
        self.eps, self.norm_eps = config.hc_eps, config.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + hc) * hc, hc * config.hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + hc) * hc))
        self.scale = nn.Parameter(torch.zeros(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """streams `[T, N, D]` -> post `[T, N]`, comb `[T, N, N]`, collapsed `[T, D]`."""
        flat = unweighted_rms(streams.flatten(1).float(), self.norm_eps)
        mixes = nn.functional.linear(flat, self.fn.float())
        if mixes.is_cuda and serves_width(mixes.shape[1]) is not None:  # one launch
            pre, post, comb = hc_kernels.hc_weights(mixes, self.base, self.scale, self.eps,
                                                    self.iters)  # fmt: skip
        else:
            pre, post, comb = hc_weights(mixes, self.base, self.scale, self.eps, self.iters)
        collapsed = (pre[:, :, None] * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def hc_weights(
    mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float, iters: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A hyper-connection's weights from its mixes `[T, (2 + N) * N]` (float32), `base` and
    `scale [3]` (the model's dtype, promoted): `pre [T, N]`, `post [T, N]` and `comb [T, N, N]`
    (softmax rows, then Sinkhorn-Knopp for `iters` rounds). The reference of
    `hc_kernels.hc_weights`, which runs on CUDA."""
    hc = math.isqrt(mixes.shape[1] + 1) - 1  # (2 + N) * N = (N + 1) ** 2 - 1
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = comb_w.view(-1, hc, hc) * comb_s + comb_b.view(hc, hc)
    comb = torch.softmax(comb, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def add_block_output(
    streams: torch.Tensor, output: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """`post` expands the block output into the streams, `comb^T` mixes the residual ones."""
    dtype = streams.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    return post.to(dtype)[:, :, None] * output[:, None, :] + mixed


class HyperHead(nn.Module):
    """`model.hc_head`: the final collapse of the streams `[T, N, D]` -> `[T, D]`."""

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        hc = config.hc_mult
        self.eps, self.norm_eps = config.hc_eps, config.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(hc, hc * config.hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(hc))
        self.hc_scale = nn.Parameter(torch.zeros(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms(streams.flatten(1).float(), self.norm_eps)
        mixes = nn.functional.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre[:, :, None] * streams).sum(dim=1).to(streams.dtype)


# ---- mixture of experts ----------------------------------------------------------------------

SCORES = {
    "sqrtsoftplus": lambda x: nn.functional.softplus(x).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda x: x.softmax(dim=-1),
}


class Router(nn.Module):
    """`mlp.gate`: expert scores `score_fn(x W^T)`; the chosen experts come from `tid2eid`
    (hash layers) or the top k of `scores + e_score_correction_bias`; their scores, normalised
    and scaled by `routed_scaling_factor`, weight them."""

    e_score_correction_bias: torch.Tensor | None
    tid2eid: torch.Tensor | None

    def __init__(self, config: DeepseekV4Config, hashed: bool) -> None:
        super().__init__()
        experts, k = config.n_routed_experts, config.num_experts_per_tok
        self.top_k, self.scale = k, config.routed_scaling_factor
        self.score_fn = SCORES[config.scoring_func]
        self.weight = nn.Parameter(torch.zeros(experts, config.hidden_size))
        bias = None if hashed else torch.zeros(experts)
        table = torch.zeros(config.vocab_size, k, dtype=torch.int64) if hashed else None
        self.register_buffer("e_score_correction_bias", bias)
        self.register_buffer("tid2eid", table)

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[T, D]` -> (weights `[T, k]`, expert ids `[T, k]`)."""
        scores = self.score_fn(nn.functional.linear(x, self.weight))
        if self.tid2eid is not None:
            ids = self.tid2eid[input_ids].long()
        else:
            assert self.e_score_correction_bias is not None
            choice = scores + self.e_score_correction_bias
            ids = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids


class SharedExpert(nn.Module):
    """`mlp.shared_experts`: one clamped SwiGLU MLP of `moe_intermediate_size` on every token."""

    def __init__(self, config: DeepseekV4Config) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.moe_intermediate_size, config.mlp_bias
        self.limit = config.swiglu_limit
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = swiglu(self.gate_proj(x), self.up_proj(x), self.limit)
        return cast(torch.Tensor, self.down_proj(hidden))


class MoE(nn.Module):
    def __init__(self, config: DeepseekV4Config, index: int) -> None:
        super().__init__()
        self.gate = Router(config, config.mlp_layer_types[index] == "hash_moe")
        self.experts = RoutedExperts(
            config.n_routed_experts,
            config.hidden_size,
            config.moe_intermediate_size,
            config.swiglu_limit,
        )
        self.shared_experts = SharedExpert(config)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, input_ids)
        return self.experts(x, weights, ids) + self.shared_experts(x)


# ---- the decoder layer -----------------------------------------------------------------------


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(
        self, config: DeepseekV4Config, index: int, backends: dict[str, AttentionBackend]
    ) -> None:
        super().__init__()
        self.self_attn = DeepseekV4Attention(config, index, backends)
        self.mlp = MoE(config, index)
        self.input_layernorm = v4_norm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = v4_norm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(
        self,
        streams: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rotary: V4Rotary,
    ) -> torch.Tensor:
        """streams `[T, hc_mult, hidden_size]` -> the same shape."""
        post, comb, collapsed = self.attn_hc(streams)
        attn = self.self_attn(self.input_layernorm(collapsed), positions, rotary)
        streams = add_block_output(streams, attn, post, comb)
        post, comb, collapsed = self.ffn_hc(streams)
        mlp = self.mlp(self.post_attention_layernorm(collapsed), input_ids)
        return add_block_output(streams, mlp, post, comb)
