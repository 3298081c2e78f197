"""Qwen3-Next's gated delta-net mixer, numerically as transformers' `Qwen3NextGatedDeltaNet`:
`in_proj_qkvz` and `in_proj_ba` into q, k, v, the output gate z, the rate b and the decay
input a; the convolution and the gated delta rule in the backend (`GatedDeltaStateBackend`,
which owns the states); then `out_proj(norm(o, z))` with the norm taken per value head."""

from __future__ import annotations

import torch
from torch import nn

from unified_attn.backend import AttentionBackend, LayerConfig
from unified_attn.backend.state_layers import GatedDeltaWeights
from unified_attn.models.gated_delta_config import GatedDeltaConfig


class HeadGatedRMSNorm(nn.Module):
    """`(weight * rmsnorm(o)) * silu(z)` over each head's channels: normalised in float32,
    cast back before the weight, the gate applied in float32 (`Qwen3NextRMSNormGated`)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """o, gate `[..., size]` in the model dtype -> `[..., size]`."""
        h = o.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(o.dtype)
        return (h * nn.functional.silu(gate.float())).to(o.dtype)


class GatedDeltaNet(nn.Module):
    """Parameter names are transformers' (`in_proj_qkvz`, `in_proj_ba`, `conv1d`, `dt_bias`,
    `A_log`, `norm`, `out_proj`); checkpoints name the module `linear_attn`, the decoder
    `self_attn` (the loader renames it)."""

    def __init__(
        self, config: GatedDeltaConfig, hidden_size: int, eps: float, layer_config: LayerConfig,
        backend: AttentionBackend,
    ) -> None:  # fmt: skip
        super().__init__()
        self.config, self.layer_config, self.backend = config, layer_config, backend
        c = config
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * c.key_dim + 2 * c.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * c.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(c.conv_dim, c.conv_dim, c.conv_kernel, groups=c.conv_dim,
                                bias=False, padding=c.conv_kernel - 1)  # fmt: skip
        self.dt_bias = nn.Parameter(torch.ones(c.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(c.num_v_heads))
        self.norm = HeadGatedRMSNorm(c.v_head_size, eps)
        self.out_proj = nn.Linear(c.value_dim, hidden_size, bias=False)

    def weights(self) -> GatedDeltaWeights:
        return GatedDeltaWeights(
            conv_weight=self.conv1d.weight[:, 0],
            conv_bias=self.conv1d.bias,
            A=-torch.exp(self.A_log.float()),
            dt_bias=self.dt_bias,
        )

    def _split(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The projections, grouped by key head in the checkpoint, as
        (`[q, k, v] [T, conv_dim]`, z `[T, Hv, Dv]`, b `[T, Hv]`, a `[T, Hv]`)."""
        c, num_tokens = self.config, hidden.shape[0]
        per_k = c.num_v_heads // c.num_k_heads  # value heads of each key head
        qkvz = self.in_proj_qkvz(hidden).view(num_tokens, c.num_k_heads, -1)
        q, k, v, z = qkvz.split([c.k_head_size, c.k_head_size, per_k * c.v_head_size,
                                 per_k * c.v_head_size], dim=-1)  # fmt: skip
        b, a = self.in_proj_ba(hidden).view(num_tokens, c.num_k_heads, -1).split(per_k, dim=-1)
        qkv = torch.cat([t.reshape(num_tokens, -1) for t in (q, k, v)], dim=-1)
        z = z.reshape(num_tokens, c.num_v_heads, c.v_head_size)
        return qkv, z, b.reshape(num_tokens, -1), a.reshape(num_tokens, -1)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """positions `[T]` (unused: no RoPE), hidden `[T, hidden_size]` -> `[T, hidden_size]`."""
        qkv, z, b, a = self._split(hidden)
        o = torch.empty(hidden.shape[0], self.config.value_dim, dtype=torch.float32,
                        device=hidden.device)  # fmt: skip
        self.backend.forward(self.layer_config, o, qkv, a, b, mixer=self.weights())
        o = self.norm(o.to(hidden.dtype).view_as(z), z)
        return self.out_proj(o.flatten(1))
