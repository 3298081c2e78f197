"""GPT-OSS mixture of experts, as a plain loop over experts (runs anywhere, graph-capturable).

Parameter names and layouts are transformers' (`mlp.router.weight [E, H]`, `.bias [E]`;
`mlp.experts.gate_up_proj [E, H, 2I]` with gate and up interleaved along the last dim,
`gate_up_proj_bias [E, 2I]`, `down_proj [E, I, H]`, `down_proj_bias [E, H]`), so a checkpoint
loads as a plain state dict.
"""

from __future__ import annotations

import torch
from torch import nn

from unified_attn.models.config import ModelConfig, MoEConfig


class TopKRouter(nn.Module):
    """Linear router; the weights are a softmax over the top-k logits only."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.top_k = moe.top_k
        self.weight = nn.Parameter(torch.zeros(moe.num_experts, hidden_size))
        self.bias = nn.Parameter(torch.zeros(moe.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[T, H]` -> (routing weights `[T, k]` in x's dtype, expert ids `[T, k]`)."""
        logits = nn.functional.linear(x, self.weight, self.bias)  # [T, E]
        top_logits, top_ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top_logits, dim=-1, dtype=top_logits.dtype), top_ids


class Experts(nn.Module):
    """`num_experts` clamped-SwiGLU MLPs stored as batched tensors."""

    def __init__(self, hidden_size: int, intermediate_size: int, moe: MoEConfig) -> None:
        super().__init__()
        num, hidden, inter = moe.num_experts, hidden_size, intermediate_size
        self.alpha, self.limit = moe.swiglu_alpha, moe.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.zeros(num, hidden, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num, 2 * inter))
        self.down_proj = nn.Parameter(torch.zeros(num, inter, hidden))
        self.down_proj_bias = nn.Parameter(torch.zeros(num, hidden))

    def expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `index` on every token: x `[T, H]` -> `[T, H]`."""
        gate_up = x @ self.gate_up_proj[index] + self.gate_up_proj_bias[index]  # [T, 2I]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return ((up + 1) * glu) @ self.down_proj[index] + self.down_proj_bias[index]

    def forward(
        self, x: torch.Tensor, routing_weights: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        """Weighted sum over each token's chosen experts, added in expert order (as
        transformers). Every expert runs on every token (weight 0 when not chosen): no
        data-dependent shapes, so no host sync."""
        out = torch.zeros_like(x)
        for index in range(self.gate_up_proj.shape[0]):
            weight = (routing_weights * (expert_ids == index)).sum(-1, keepdim=True)  # [T, 1]
            out += (self.expert(index, x) * weight).to(x.dtype)
        return out


class MoEMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.moe is not None  # ModelConfig validates mlp_kind="moe" against it
        self.router = TopKRouter(config.hidden_size, config.moe)
        self.experts = Experts(config.hidden_size, config.intermediate_size, config.moe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, H]` -> `[T, H]`."""
        routing_weights, expert_ids = self.router(x)
        return self.experts(x, routing_weights, expert_ids)
