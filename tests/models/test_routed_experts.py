"""Routed SwiGLU experts (`moe.RoutedExperts`: Mixtral, Qwen2-MoE, DeepSeek-V2/V3/V4): the
reference equals each token's weighted sum over its chosen experts, and checkpoints'
per-expert matrices are stacked. The HF parity tests run the reference against transformers,
test_grouped_experts.py the CUDA kernels against it."""

from __future__ import annotations

import pytest
import torch

from unified_attn.models import moe


@pytest.mark.parametrize("limit", [None, 0.4])
def test_the_reference_is_each_tokens_weighted_sum_over_its_experts(limit):
    experts = moe.RoutedExperts(8, 32, 24, limit)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    x = torch.randn(9, 32, generator=gen)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, generator=gen)
    want = torch.zeros(9, 32, dtype=torch.float64)
    for t in range(9):
        for j in range(2):
            gate_up, down = experts.gate_up_proj[ids[t, j]].double(), experts.down_proj[ids[t, j]]
            gate, up = (gate_up @ x[t].double()).chunk(2)
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            want[t] += weights[t, j] * (down.double() @ (gate * torch.sigmoid(gate) * up))
    got = experts.reference(x, weights, ids)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert want.abs().max() > 0.1  # the experts did contribute


def test_per_expert_matrices_are_stacked_and_incomplete_sets_kept_for_the_name_check():
    gen = torch.Generator().manual_seed(1)
    gate, up, down = (torch.randn(3, 4, 5, generator=gen) for _ in range(3))
    state = {"m.experts.0.gate_proj.weight": gate[0], "m.shared_experts.gate_proj.weight": up[0]}
    for e in range(3):
        for name, tensor in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            state[f"l.experts.{e}.{name}.weight"] = tensor[e]
    out = moe.stack_expert_weights(state, "gate_proj", "up_proj", "down_proj")
    torch.testing.assert_close(out["l.experts.gate_up_proj"], torch.cat([gate, up], dim=1))
    torch.testing.assert_close(out["l.experts.down_proj"], down)
    # expert 0 alone, with no up or down: left under its own name, for check_state to report
    kept = {"m.experts.0.gate_proj.weight", "m.shared_experts.gate_proj.weight"}
    assert set(out) == {"l.experts.gate_up_proj", "l.experts.down_proj"} | kept
