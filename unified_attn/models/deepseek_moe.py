"""DeepSeekMoE, the MLP of DeepSeek-V2/V3 layers from `first_k_dense_replace` on (numerically as
transformers, eval mode): routed SwiGLU experts `mlp.experts.{e}`, a shared SwiGLU
`mlp.shared_experts` added on every token, and a float32 router `mlp.gate`: V3 scores experts
with a sigmoid, picks the `topk_group` groups whose two best `score + e_score_correction_bias`
are largest, the top-k experts of those by the same sum, and weights them by their plain scores
(renormalised with `norm_topk_prob`); V2 takes a softmax and its top-k (`greedy`) or the top-k
within the `topk_group` groups of largest maximum (`group_limited_greedy`), never renormalised
(as transformers). Both multiply the weights by `routed_scaling_factor`.

The routed experts are `moe.RoutedExperts`, stacked as transformers holds them: on CUDA each
expert runs only on its tokens (`grouped_experts`), elsewhere every expert runs on every token
with weight 0 where not chosen.
"""

from __future__ import annotations

import torch
from torch import nn

from unified_attn.models.deepseek_config import DeepseekConfig
from unified_attn.models.mlp import MLP
from unified_attn.models.moe import RoutedExperts


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
            assert self.e_score_correction_bias is not None and cfg.n_group is not None
            assert cfg.topk_group is not None
            return sigmoid_group_routing(
                logits, self.e_score_correction_bias, n_group=cfg.n_group,
                topk_group=cfg.topk_group, top_k=cfg.num_experts_per_tok,
                norm_topk_prob=cfg.norm_topk_prob, scale=cfg.routed_scaling_factor,
            )  # fmt: skip
        scores = logits.softmax(dim=-1)
        if cfg.routing == "group_limited_greedy":
            assert cfg.n_group is not None and cfg.topk_group is not None
            group_scores = _groups(scores, cfg.n_group).amax(-1)
            scores = _keep_best_groups(scores, group_scores, cfg.topk_group, 0.0)
        weights, ids = scores.topk(cfg.num_experts_per_tok, dim=-1, sorted=False)
        return weights * cfg.routed_scaling_factor, ids


def sigmoid_group_routing(
    logits: torch.Tensor, correction_bias: torch.Tensor, *, n_group: int, topk_group: int,
    top_k: int, norm_topk_prob: bool, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """DeepSeek-V3's routing (Nemotron-H's too): float32 logits `[T, E]` -> (weights `[T, k]`
    float32, ids `[T, k]`). Sigmoid scores; the `topk_group` groups whose two best
    `score + correction_bias` are largest; their top-k experts by that sum, weighted by their
    plain scores (renormalised with `norm_topk_prob`), times `scale`."""
    scores = logits.sigmoid()
    choice = scores + correction_bias
    group_scores = _groups(choice, n_group).topk(2, dim=-1).values.sum(-1)  # [T, G]
    choice = _keep_best_groups(choice, group_scores, topk_group, float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def _groups(scores: torch.Tensor, n_group: int) -> torch.Tensor:
    """`[T, E]` -> `[T, n_group, E / n_group]`."""
    return scores.view(scores.shape[0], n_group, -1)


def _keep_best_groups(
    scores: torch.Tensor, group_scores: torch.Tensor, topk_group: int, fill: float
) -> torch.Tensor:
    """`scores [T, E]` with the experts outside the `topk_group` best groups set to `fill`."""
    best = group_scores.topk(topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    n_group = group_scores.shape[1]
    keep = keep[:, :, None].expand_as(_groups(scores, n_group)).reshape(scores.shape)
    return scores.masked_fill(~keep, fill)


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
