"""DeepSeek-V4's routed experts: the batched form (every expert in two matrix products, for few
tokens) and the per-expert loop (for many) give the same sum; the HF parity tests
(test_deepseek_v4_hf.py) run the batched form against transformers."""

from __future__ import annotations

import torch

from unified_attn.models import V4_PRESETS
from unified_attn.models import deepseek_v4_layers as layers


def test_the_batched_experts_equal_the_loop_over_experts(monkeypatch):
    config = V4_PRESETS["deepseek-v4-like"]
    experts = layers.Experts(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    x = torch.randn(9, config.hidden_size, generator=gen)
    num = config.n_routed_experts
    ids = torch.stack([torch.randperm(num, generator=gen)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, generator=gen)
    batched = experts(x, weights, ids)
    monkeypatch.setattr(layers, "BATCHED_BYTES", 0)  # every token count takes the loop
    looped = experts(x, weights, ids)
    torch.testing.assert_close(batched, looped, rtol=1e-5, atol=1e-6)
    assert batched.abs().max() > 0.1  # the experts did contribute
