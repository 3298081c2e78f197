"""DeepSeekMoE, the MLP of DeepSeek-V2/V3 layers from `first_k_dense_replace` on (numerically as
transformers, eval mode): routed SwiGLU experts `mlp.experts.{e}`, a shared SwiGLU
`mlp.shared_experts` added on every token, and a float32 router `mlp.gate`: V3 scores experts
with a sigmoid, picks the `topk_group` groups whose two best `score + e_score_correction_bias`
are largest, the top-k experts of those by the same sum, and weights them by their plain scores
(renormalised with `norm_topk_prob`); V2 takes a softmax and its top-k (`greedy`) or the top-k
within the `topk_group` groups of largest maximum (`group_limited_greedy`), never renormalised
(as transformers). Both multiply the weights by `routed_scaling_factor`.

`RoutedExperts` holds the routed experts stacked, as transformers does (`gate_up_proj [E, 2I,
D]`, `down_proj [E, D, I]`; DeepSeek-V4's `Experts` too): on CUDA each expert runs only on its
tokens (`grouped_experts`), elsewhere every expert runs on every token with weight 0 where not
chosen. `stack_expert_weights` stacks checkpoints' per-expert matrices into that layout.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from unified_attn.models.deepseek_config import DeepseekConfig
from unified_attn.models.grouped_experts import grouped_experts
from unified_attn.models.mlp import MLP

BATCHED_BYTES = 256 * 2**20  # the most the reference holds as `[E, T, 2I]` to run experts at once


class DeepseekRouter(nn.Module):
    """`mlp.gate`: float32 logits over the experts -> (weights `[T, k]` float32, ids `[T, k]`)."""

    e_score_correction_bias: torch.Tensor | None

    def __init__(self, config: DeepseekConfig) -> None:
        super().__init__()
        self.config = config
        experts = config.n_routed_experts
        self.weight = nn.Parameter(torch.zeros(experts, config.hidden_size))
        bias = torch.zeros(experts) if config.version == "v3" else None
        self.register_buffer("e_score_correction_bias", bias)  # kept in float32

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        logits = nn.functional.linear(x.float(), self.weight.float())  # [T, E]
        if cfg.routing == "sigmoid_group_limited":
            assert self.e_score_correction_bias is not None
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
            group_scores = _groups(choice, cfg).topk(2, dim=-1).values.sum(-1)  # [T, G]
            choice = _keep_best_groups(choice, group_scores, cfg, float("-inf"))
            ids = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False).indices
            weights = scores.gather(1, ids)
            if cfg.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            return weights * cfg.routed_scaling_factor, ids
        scores = logits.softmax(dim=-1)
        if cfg.routing == "group_limited_greedy":
            scores = _keep_best_groups(scores, _groups(scores, cfg).amax(-1), cfg, 0.0)
        weights, ids = scores.topk(cfg.num_experts_per_tok, dim=-1, sorted=False)
        return weights * cfg.routed_scaling_factor, ids


def _groups(scores: torch.Tensor, cfg: DeepseekConfig) -> torch.Tensor:
    """`[T, E]` -> `[T, n_group, E / n_group]`."""
    assert cfg.n_group is not None
    return scores.view(scores.shape[0], cfg.n_group, -1)


def _keep_best_groups(
    scores: torch.Tensor, group_scores: torch.Tensor, cfg: DeepseekConfig, fill: float
) -> torch.Tensor:
    """`scores [T, E]` with the experts outside the `topk_group` best groups set to `fill`."""
    assert cfg.topk_group is not None
    best = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    keep = keep[:, :, None].expand_as(_groups(scores, cfg)).reshape(scores.shape)
    return scores.masked_fill(~keep, fill)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """`silu(gate) * up`; with `limit` (DeepSeek-V4) gate clamped to at most `limit` and up to
    `[-limit, limit]` first."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return nn.functional.silu(gate) * up


class RoutedExperts(nn.Module):
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

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x `[T, D]`, the router's weights and expert ids `[T, k]` -> the weighted sum over each
        token's chosen experts `[T, D]`: the grouped kernels on CUDA, else `reference`."""
        if x.is_cuda:
            return grouped_experts(x, weights, ids, self.gate_up_proj, self.down_proj, self.limit)
        return self.reference(x, weights, ids)

    def reference(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, weight 0 where not chosen, added in expert order (as
        transformers). Few tokens run every expert in two batched matrix products, summed in
        float32 and cast once; more loop over the experts, whose `[E, T, 2I]` would not fit
        `BATCHED_BYTES`."""
        experts, inner = self.gate_up_proj.shape[:2]
        chosen = ids[:, :, None] == torch.arange(experts, device=ids.device)
        weight = (weights[:, :, None] * chosen).sum(1)  # [T, E], 0: not chosen
        if experts * x.shape[0] * inner * x.element_size() <= BATCHED_BYTES:
            gate, up = torch.matmul(x, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
            hidden = swiglu(gate, up, self.limit)  # [E, T, I]
            each = torch.matmul(hidden, self.down_proj.transpose(1, 2))  # [E, T, D]
            return (each * weight.t()[:, :, None]).sum(0).to(x.dtype)
        out = torch.zeros_like(x)
        for index in range(experts):
            gate, up = nn.functional.linear(x, self.gate_up_proj[index]).chunk(2, dim=-1)
            hidden = swiglu(gate, up, self.limit)
            out += (nn.functional.linear(hidden, self.down_proj[index])
                    * weight[:, index, None]).to(x.dtype)  # fmt: skip
        return out


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


class DeepseekMoE(nn.Module):
    """Routed experts (weighted, added in expert order as transformers) plus the shared ones."""

    def __init__(self, config: DeepseekConfig) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        self.gate = DeepseekRouter(config)
        self.experts = RoutedExperts(config.n_routed_experts, hidden, inter, None)
        shared = inter * config.n_shared_experts
        self.shared_experts = MLP(hidden, shared, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self.experts(x, weights, ids) + self.shared_experts(x)
