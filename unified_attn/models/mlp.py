"""Feed-forward blocks: gated MLPs (SwiGLU, GeGLU) and the factory choosing by `mlp_kind`."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from unified_attn.models.config import ModelConfig


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return nn.functional.gelu(x, approximate="tanh")  # transformers' gelu_pytorch_tanh


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "swiglu": nn.functional.silu,
    "geglu": _gelu_tanh,
}


class MLP(nn.Module):
    """Gated MLP: `down(act(gate(x)) * up(x))`; SiLU for SwiGLU (Llama), tanh-GELU for GeGLU
    (Gemma)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.act = ACTIVATIONS[config.mlp_kind]
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def make_mlp(config: ModelConfig) -> nn.Module:
    """The feed-forward block of one layer: `[T, hidden] -> [T, hidden]`."""
    if config.mlp_kind == "moe":
        from unified_attn.models.moe import MoEMLP

        return MoEMLP(config)
    return MLP(config)
