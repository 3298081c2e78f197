"""The Mamba-2 mixer of a state-space hybrid, numerically as transformers' `Mamba2Mixer` (and
Bamba's, Nemotron-H's, Granite-4.0-H's, which are the same layer): `in_proj` into the gate z,
the convolution's input `[x, B, C]` and dt; the convolution and the SSD scan in the backend
(`Mamba2StateBackend`, which owns the states); then `out_proj(norm(y * silu(z)))` with the norm
taken per group of channels."""

from __future__ import annotations

import torch
from torch import nn

from unified_attn.backend import AttentionBackend, LayerConfig
from unified_attn.backend.state_layers import Mamba2Weights
from unified_attn.models.hybrid_config import Mamba2Config


class GatedRMSNorm(nn.Module):
    """`weight * rmsnorm(y * silu(z))` over each of `groups` equal slices of the channels, in
    float32, cast back before the weight (transformers' `MambaRMSNormGated`)."""

    def __init__(self, size: int, groups: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.groups, self.eps = groups, eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        h = y.float() * nn.functional.silu(gate.float())
        grouped = h.view(*h.shape[:-1], self.groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * grouped.view(h.shape).to(dtype)


class Mamba2Mixer(nn.Module):
    """Parameter names are transformers': `in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`, `norm`,
    `out_proj`."""

    def __init__(
        self, config: Mamba2Config, hidden_size: int, eps: float, layer_config: LayerConfig,
        backend: AttentionBackend,
    ) -> None:  # fmt: skip
        super().__init__()
        self.config, self.layer_config, self.backend = config, layer_config, backend
        inner, conv = config.inner_size, config.conv_dim
        self.in_proj = nn.Linear(hidden_size, config.in_proj_size, bias=config.proj_bias)
        self.conv1d = nn.Conv1d(conv, conv, config.conv_kernel, groups=conv,
                                bias=config.conv_bias, padding=config.conv_kernel - 1)  # fmt: skip
        self.dt_bias = nn.Parameter(torch.ones(config.num_heads))
        self.A_log = nn.Parameter(torch.zeros(config.num_heads))
        self.D = nn.Parameter(torch.ones(config.num_heads))
        self.norm = GatedRMSNorm(inner, config.norm_groups, eps)
        self.out_proj = nn.Linear(inner, hidden_size, bias=config.proj_bias)

    def weights(self) -> Mamba2Weights:
        return Mamba2Weights(
            conv_weight=self.conv1d.weight[:, 0],
            conv_bias=self.conv1d.bias,
            A=-torch.exp(self.A_log.float()),
            D=self.D,
            dt_bias=self.dt_bias,
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """positions `[T]` (unused), hidden `[T, hidden_size]` -> `[T, hidden_size]`."""
        config = self.config
        gate, xbc, dt = self.in_proj(hidden).split(
            [config.inner_size, config.conv_dim, config.num_heads], dim=-1
        )
        y = torch.empty(hidden.shape[0], config.inner_size, dtype=torch.float32,
                        device=hidden.device)  # fmt: skip
        self.backend.forward(self.layer_config, y, xbc, dt, xbc, mixer=self.weights())
        return self.out_proj(self.norm(y, gate, hidden.dtype))
