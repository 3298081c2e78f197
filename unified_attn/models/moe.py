"""Mixtures of experts, with no data-dependent shapes and no host sync (graph-capturable).

`RoutedExperts` (SwiGLU experts: Mixtral, Qwen2-MoE, DeepSeek-V2/V3/V4) and GPT-OSS's
`Experts` run each expert only on its tokens on CUDA (`grouped_experts`; batch-invariant mode
with one tile configuration for every batch); off CUDA every expert runs on every token with
weight 0 where it was not chosen.

Two parameter layouts, transformers' own (`MoEConfig.expert_kind`):

- `clamped_swiglu` (GPT-OSS, `MoEMLP`): `mlp.router.weight [E, H]`, `.bias [E]`;
  `mlp.experts.gate_up_proj [E, H, 2I]` with gate and up interleaved along the last dim,
  `gate_up_proj_bias [E, 2I]`, `down_proj [E, I, H]`, `down_proj_bias [E, H]`.
- `swiglu` (Mixtral, Qwen2-MoE, `SparseMoEMLP`): `mlp.gate.weight [E, H]`;
  `mlp.experts.gate_up_proj [E, 2I, H]` (gate rows, then up rows) and `down_proj [E, H, I]`;
  Qwen2-MoE's `mlp.shared_expert.*` and `mlp.shared_expert_gate.weight [1, H]`. Checkpoints
  store each expert apart (`mlp.experts.{e}.gate_proj / up_proj / down_proj.weight`; Mixtral's
  `block_sparse_moe.*` and `w1 / w3 / w2`, which `hf_families.WEIGHT_RENAMES` maps): the loader
  stacks them (`stack_expert_weights`). Llama 4 (`InputScaledMoEMLP`) uses this layout too:
  its checkpoints' `feed_forward.experts.gate_up_proj [E, H, 2I]` and `down_proj [E, I, H]`
  are transposed on load (`hf_llama4.llama4_expert_weights`); router `mlp.router.weight`.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from unified_attn.kernels.moe.grouped_experts import (
    Activation,
    ExpertWeights,
    GroupedConfig,
    grouped_experts,
)
from unified_attn.models.config import ModelConfig, MoEConfig
from unified_attn.models.mlp import MLP


class TopKRouter(nn.Module):
    """Linear router (with a bias for GPT-OSS). `router_softmax="top_k"`: a softmax over the
    top-k logits only, in x's dtype (GPT-OSS); `"all"`: a float32 softmax over every expert, then
    the top-k probabilities, renormalised when `norm_topk_prob` (Mixtral, Qwen2-MoE), in float32
    or rounded to x's dtype (`routing_weights_dtype`); `"sigmoid"`: the sigmoid of each top-k
    logit, in float32 rounded to x's dtype (Llama 4)."""

    bias: nn.Parameter | None

    def __init__(self, hidden_size: int, moe: MoEConfig, *, bias: bool = True) -> None:
        super().__init__()
        self.top_k, self.softmax, self.norm = moe.top_k, moe.router_softmax, moe.norm_topk_prob
        self.round_weights = moe.routing_weights_dtype == "model"
        self.weight = nn.Parameter(torch.zeros(moe.num_experts, hidden_size))
        self.bias = nn.Parameter(torch.zeros(moe.num_experts)) if bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[T, H]` -> (routing weights `[T, k]`, expert ids `[T, k]`); the weights are in x's
        dtype for `"top_k"`, for `"all"` float32 unless `routing_weights_dtype="model"`."""
        logits = self._logits(x)  # [T, E]
        if self.softmax == "top_k":
            top_logits, top_ids = torch.topk(logits, self.top_k, dim=-1)
            return self._softmax(top_logits, top_logits.dtype), top_ids
        if self.softmax == "sigmoid":
            top_logits, top_ids = torch.topk(logits, self.top_k, dim=-1)
            return self._sigmoid(top_logits.float()).to(x.dtype), top_ids
        probs = self._softmax(logits, torch.float32)
        top_probs, top_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm:
            top_probs = top_probs / self._sum(top_probs)
        return (top_probs.to(x.dtype) if self.round_weights else top_probs), top_ids

    # The ops batch-invariant mode replaces (`models/invariant/model.py`).
    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)

    @staticmethod
    def _softmax(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Over the last dimension, computed in `dtype` (x cast first)."""
        return torch.softmax(x.to(dtype), dim=-1)

    @staticmethod
    def _sum(x: torch.Tensor) -> torch.Tensor:
        """`[T, k] -> [T, 1]`: each row's sum."""
        return x.sum(dim=-1, keepdim=True)

    @staticmethod
    def _sigmoid(x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x)


def _expert_weight(
    routing_weights: torch.Tensor, expert_ids: torch.Tensor, index: int
) -> torch.Tensor:
    """`[T, 1]`: each token's routing weight for expert `index`, 0 where it was not chosen."""
    return (routing_weights * (expert_ids == index)).sum(-1, keepdim=True)


class StackedExperts(nn.Module):
    """What both expert layouts share: the weighted sum over each token's chosen experts, each
    expert only on its tokens on CUDA (`grouped_experts`), else `reference`."""

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x `[T, D]`, the router's weights and expert ids `[T, k]` -> `[T, D]`."""
        if x.is_cuda:
            return grouped_experts(x, weights, ids, *self.kernel_weights(), self._tile_config(x))
        return self.reference(x, weights, ids)

    def _tile_config(self, x: torch.Tensor) -> GroupedConfig | None:
        """The grouped kernels' tile configuration (None: theirs for the batch size);
        batch-invariant mode fixes one for every batch."""
        return None

    def kernel_weights(self) -> tuple[ExpertWeights, Activation]:
        """The parameters (no copies) and the activation as `grouped_experts` takes them."""
        raise NotImplementedError

    def reference(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The same sum in torch (off CUDA), rounded as transformers rounds it."""
        raise NotImplementedError


class Experts(StackedExperts):
    """GPT-OSS's `num_experts` clamped-SwiGLU MLPs with biases, stacked (gate and up in
    alternate columns): grouped on CUDA, else `reference`."""

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
        gate_up = self._project(x, self.gate_up_proj[index], self.gate_up_proj_bias[index])
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * self._sigmoid(gate * self.alpha)
        return self._project((up + 1) * glu, self.down_proj[index], self.down_proj_bias[index])

    @staticmethod
    def _project(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """`x [T, K] @ w [K, N] + bias [N]` (batch-invariant mode replaces it)."""
        return x @ w + bias

    @staticmethod
    def _sigmoid(x: torch.Tensor) -> torch.Tensor:
        """(Batch-invariant mode replaces it.)"""
        return torch.sigmoid(x)

    def kernel_weights(self) -> tuple[ExpertWeights, Activation]:
        """The parameters (no copies) and the activation as `grouped_experts` takes them."""
        stacked = ExpertWeights(self.gate_up_proj, self.down_proj, self.gate_up_proj_bias,
                                self.down_proj_bias, interleaved=True)  # fmt: skip
        return stacked, Activation(limit=self.limit, alpha=self.alpha)

    def reference(
        self, x: torch.Tensor, routing_weights: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        """Every expert on every token (weight 0 when not chosen), each weighted output rounded
        to x's dtype and added in expert order: transformers' sum."""
        out = torch.zeros_like(x)
        for index in range(self.gate_up_proj.shape[0]):
            weight = _expert_weight(routing_weights, expert_ids, index)
            out += (self.expert(index, x) * weight).to(x.dtype)
        return out


def swiglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    limit: float | None = None,
    silu: Callable[[torch.Tensor], torch.Tensor] = nn.functional.silu,
) -> torch.Tensor:
    """`silu(gate) * up`; with `limit` (DeepSeek-V4) gate clamped to at most `limit` and up to
    `[-limit, limit]` first (exact, so batch-invariant mode passes only its own `silu`)."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return silu(gate) * up


class RoutedExperts(StackedExperts):
    """`mlp.experts`: `gate_up_proj [E, 2I, D]` (gate rows, then up rows), `down_proj
    [E, D, I]`; SwiGLU experts, clamped to `limit` when given (DeepSeek-V4)."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, limit: float | None
    ) -> None:
        super().__init__()
        self.limit = limit
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size,
                                                     hidden_size))  # fmt: skip
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden_size, intermediate_size))

    def kernel_weights(self) -> tuple[ExpertWeights, Activation]:
        """The parameters (no copies) and the activation as `grouped_experts` takes them."""
        return ExpertWeights(self.gate_up_proj, self.down_proj), Activation(limit=self.limit)

    def reference(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, weight 0 where not chosen, each weighted output rounded
        to x's dtype and added in expert order: transformers' sum, rounding included."""
        out = torch.zeros_like(x)
        for index in range(self.gate_up_proj.shape[0]):
            gate, up = self._linear(x, self.gate_up_proj[index]).chunk(2, dim=-1)
            hidden = swiglu(gate, up, self.limit, self._silu)
            each = self._linear(hidden, self.down_proj[index])
            out += (each * _expert_weight(weights, ids, index)).to(x.dtype)
        return out

    # The ops batch-invariant mode replaces (`models/invariant/model.py`).
    @staticmethod
    def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, weight)

    @staticmethod
    def _silu(x: torch.Tensor) -> torch.Tensor:
        return nn.functional.silu(x)


_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")


def stack_expert_weights(
    state: dict[str, torch.Tensor], gate: str, up: str, down: str
) -> dict[str, torch.Tensor]:
    """`state` with each set of per-expert matrices `{prefix}.{e}.{gate|up|down}.weight`
    stacked into `{prefix}.gate_up_proj [E, 2I, D]` and `{prefix}.down_proj [E, D, I]`. A set
    whose experts are not exactly 0..E-1 for all three is left as it is, so the loader's name
    check reports it."""
    out: dict[str, torch.Tensor] = {}
    sets: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in state.items():
        match = _PER_EXPERT.match(name)
        if match and match.group(3) in (gate, up, down):
            prefix, index, which = match.groups()
            sets.setdefault(prefix, {}).setdefault(which, {})[int(index)] = tensor
        else:
            out[name] = tensor
    for prefix, parts in sets.items():
        count = len(parts.get(gate, ()))
        if all(sorted(parts.get(w, ())) == list(range(count)) for w in (gate, up, down)):
            stack = {w: torch.stack([parts[w][e] for e in range(count)]) for w in parts}
            out[f"{prefix}.gate_up_proj"] = torch.cat([stack[gate], stack[up]], dim=1)
            out[f"{prefix}.down_proj"] = stack[down]
        else:
            out.update({f"{prefix}.{e}.{w}.weight": t for w in parts for e, t in parts[w].items()})
    return out


class MoEMLP(nn.Module):
    """GPT-OSS: router with bias, clamped-SwiGLU experts as batched tensors."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.moe is not None  # ModelConfig validates mlp_kind="moe" against it
        self.router = TopKRouter(config.hidden_size, config.moe)
        self.experts = Experts(config.hidden_size, config.intermediate_size, config.moe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, H]` -> `[T, H]`."""
        routing_weights, expert_ids = self.router(x)
        return self.experts(x, routing_weights, expert_ids)


class SparseMoEMLP(nn.Module):
    """Mixtral and Qwen2-MoE: router without bias, SwiGLU experts, and (Qwen2-MoE) a shared
    expert gated by `sigmoid(shared_expert_gate(x))`, added to the experts' sum."""

    shared_expert: MLP | None
    shared_expert_gate: nn.Linear | None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None  # ModelConfig validates mlp_kind="moe" against it
        hidden = config.hidden_size
        inter = moe.intermediate_size or config.intermediate_size
        self.gate = TopKRouter(hidden, moe, bias=False)
        self.experts = RoutedExperts(moe.num_experts, hidden, inter, None)
        shared = moe.shared_expert_intermediate_size
        self.shared_expert = None if shared is None else MLP(hidden, shared)
        self.shared_expert_gate = None if shared is None else nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, H]` -> `[T, H]`."""
        out = self.experts(x, *self.gate(x))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + self._gate(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    @staticmethod
    def _gate(logit: torch.Tensor) -> torch.Tensor:
        """The shared expert's gate, `sigmoid` of its `[T, 1]` logit."""
        return torch.sigmoid(logit)


class InputScaledMoEMLP(nn.Module):
    """Llama 4: each chosen expert runs on the token scaled by its routing weight (the
    router's sigmoid), `sum_j expert_j(w_j * x)`, plus an ungated shared expert."""

    shared_expert: MLP | None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None  # ModelConfig validates mlp_kind="moe" against it
        hidden = config.hidden_size
        inter = moe.intermediate_size or config.intermediate_size
        self.router = TopKRouter(hidden, moe, bias=False)
        self.experts = RoutedExperts(moe.num_experts, hidden, inter, None)
        shared = moe.shared_expert_intermediate_size
        self.shared_expert = None if shared is None else MLP(hidden, shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, H]` -> `[T, H]`: one expert pass per choice, with weight 1 on its output."""
        weights, ids = self.router(x)  # [T, k] each
        ones = torch.ones_like(weights[:, :1])
        out = self._choice(x, weights, ids, 0, ones)
        for j in range(1, ids.shape[1]):
            out = out + self._choice(x, weights, ids, j, ones)
        return out if self.shared_expert is None else self.shared_expert(x) + out

    def _choice(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, j: int, ones: torch.Tensor
    ) -> torch.Tensor:
        """Each token's `j`-th chosen expert on the token scaled by its weight: `[T, H]` (the
        grouped kernels take contiguous expert ids)."""
        return self.experts(x * weights[:, j : j + 1], ones, ids[:, j : j + 1].contiguous())


def make_moe(config: ModelConfig) -> nn.Module:
    """The mixture of experts of `config.moe.expert_kind` (and `scale_input`)."""
    assert config.moe is not None
    if config.moe.scale_input:
        return InputScaledMoEMLP(config)
    if config.moe.expert_kind == "swiglu":
        return SparseMoEMLP(config)
    return MoEMLP(config)
