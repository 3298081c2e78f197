"""The hybrids' feed-forward blocks: a dense MLP (`FeedForward`) and a mixture of experts
(`HybridMoE`) of Granite-4.0-H or Nemotron-H.

`HybridMoE`'s parameter names are transformers' Nemotron-H ones: `gate.weight [E, H]` (and
`gate.e_score_correction_bias [E]`, float32, with sigmoid-grouped routing), the stacked experts
(`experts.gate_up_proj [E, 2I, H]` and `experts.down_proj [E, H, I]` for SwiGLU experts,
`experts.up_proj [E, I, H]` and `experts.down_proj [E, H, I]` for squared-ReLU ones), and
`shared_experts.*` (a `FeedForward`). Granite's checkpoint names are mapped onto them on load.
"""

from __future__ import annotations

import torch
from torch import nn

from unified_attn.kernels.moe.grouped_experts import Activation, ExpertWeights
from unified_attn.models.config import MoEConfig
from unified_attn.models.deepseek_moe import sigmoid_group_routing
from unified_attn.models.hybrid_config import HybridMoEConfig, MLPActivation
from unified_attn.models.moe import RoutedExperts, StackedExperts, TopKRouter


class FeedForward(nn.Module):
    """`down(silu(gate(x)) * up(x))` (Bamba, Granite) or `down(relu(up(x)) ** 2)`
    (Nemotron-H)."""

    def __init__(self, hidden: int, inner: int, activation: MLPActivation, bias: bool) -> None:
        super().__init__()
        self.gated = activation == "silu_gated"
        if self.gated:
            self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        up = self.up_proj(hidden)
        if self.gated:
            return self.down_proj(nn.functional.silu(self.gate_proj(hidden)) * up)
        return self.down_proj(torch.relu(up).square())


class GroupedSigmoidRouter(nn.Module):
    """Nemotron-H's `mixer.gate` (DeepSeek-V3's routing, `deepseek_moe.sigmoid_group_routing`):
    x `[T, H]` -> (weights `[T, k]` float32, expert ids `[T, k]`)."""

    e_score_correction_bias: torch.Tensor

    def __init__(self, hidden_size: int, moe: HybridMoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.zeros(moe.num_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(moe.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe = self.moe
        logits = nn.functional.linear(x.float(), self.weight.float())  # [T, E]
        return sigmoid_group_routing(
            logits, self.e_score_correction_bias.float(), n_group=moe.n_group,
            topk_group=moe.topk_group, top_k=moe.top_k, norm_topk_prob=moe.norm_topk_prob,
            scale=moe.routed_scaling_factor,
        )  # fmt: skip


class Relu2Experts(StackedExperts):
    """Nemotron-H's experts, `down(relu(up(x)) ** 2)` without a gate: `up_proj [E, I, H]`,
    `down_proj [E, H, I]`. Each expert runs only on its tokens: on CUDA in the grouped kernels
    (`Activation(relu2=True)`, `up_proj` as the ungated `gate_up`; each weighted output rounded
    to x's dtype before the float32 sum), elsewhere `reference`."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.up_proj = nn.Parameter(torch.zeros(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden_size, intermediate_size))

    def kernel_weights(self) -> tuple[ExpertWeights, Activation]:
        """The parameters (no copies) and the activation as `grouped_experts` takes them."""
        return ExpertWeights(self.up_proj, self.down_proj), Activation(relu2=True)

    def reference(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x `[T, H]`, weights and ids `[T, k]` -> `[T, H]` in x's dtype: transformers' loop
        (its rows in its order), each chosen expert on its tokens in expert order, the weighted
        outputs added in float32 and rounded once. Data-dependent shapes: not for CUDA graphs."""
        out = torch.zeros_like(x, dtype=torch.float32)
        for index in ids.unique().tolist():  # ascending
            choice, token = torch.where(ids.t() == index)  # choice-major, as transformers
            hidden = torch.relu(nn.functional.linear(x[token], self.up_proj[index])).square()
            each = nn.functional.linear(hidden, self.down_proj[index])
            out.index_add_(0, token, each * weights[token, choice, None])
        return out.to(x.dtype)


class HybridMoE(nn.Module):
    """Routed experts plus the shared expert (added after them, as transformers)."""

    shared_experts: FeedForward | None

    def __init__(self, hidden_size: int, moe: HybridMoEConfig, bias: bool) -> None:
        super().__init__()
        self.gate = _router(hidden_size, moe)
        experts, inner = moe.num_experts, moe.intermediate_size
        self.experts = (
            RoutedExperts(experts, hidden_size, inner, None)
            if moe.activation == "silu_gated"
            else Relu2Experts(experts, hidden_size, inner)
        )
        shared = moe.shared_intermediate_size
        self.shared_experts = (
            None if shared is None else FeedForward(hidden_size, shared, moe.activation, bias)
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """hidden `[T, H]` -> `[T, H]`."""
        out = self.experts(hidden, *self.gate(hidden))
        if self.shared_experts is not None:
            out = out + self.shared_experts(positions, hidden)
        return out


def _router(hidden_size: int, moe: HybridMoEConfig) -> nn.Module:
    """Granite's softmax over the top-k logits is `moe.TopKRouter`'s `"top_k"` routing."""
    if moe.routing == "sigmoid_grouped":
        return GroupedSigmoidRouter(hidden_size, moe)
    top_k = MoEConfig(num_experts=moe.num_experts, top_k=moe.top_k, expert_kind="swiglu",
                      router_softmax="top_k")  # fmt: skip
    return TopKRouter(hidden_size, top_k, bias=False)
