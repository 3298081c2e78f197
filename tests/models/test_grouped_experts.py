"""The grouped experts kernels (`kernels/moe/grouped_experts.py`; CPU: the interpreter) against the
torch references `RoutedExperts.reference` (gate and up as row blocks: Mixtral, Qwen2-MoE,
DeepSeek), `Experts.reference` (GPT-OSS: interleaved, biases, its activation) and
`Relu2Experts.reference` (Nemotron-H: ungated `relu(up) ** 2`), which the HF parity tests check
against transformers."""

from __future__ import annotations

import copy

import pytest
import torch

from unified_attn.kernels.moe import grouped_experts as grouped
from unified_attn.kernels.moe.grouped_experts import (
    Activation,
    ExpertWeights,
    GroupedConfig,
    grouped_experts,
)
from unified_attn.models.config import MoEConfig
from unified_attn.models.hybrid_ffn import Relu2Experts
from unified_attn.models.moe import Experts, RoutedExperts, StackedExperts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _experts(num: int, hidden: int, inter: int, limit: float | None, dtype: torch.dtype,
             seed: int = 0, kind: str = "row-blocks") -> StackedExperts:  # fmt: skip
    """GPT-OSS's experts use `limit` as their clamp (alpha 1.702), the row blocks as V4's;
    the ungated relu2 experts have none."""
    experts: StackedExperts
    if kind == "gpt-oss":
        moe = MoEConfig(num_experts=num, top_k=1, swiglu_limit=limit or 7.0)
        experts = Experts(hidden, inter, moe)
    elif kind == "relu2":
        experts = Relu2Experts(num, hidden, inter)
    else:
        experts = RoutedExperts(num, hidden, inter, limit)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * hidden**-0.5)
    return experts.to(DEVICE, dtype)


def _routing(tokens: int, num: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num, generator=gen)[:k] for _ in range(tokens)])
    return torch.rand(tokens, k, generator=gen).to(DEVICE), ids.to(DEVICE)


@pytest.mark.parametrize("kind", ["row-blocks", "gpt-oss", "relu2"])
@pytest.mark.parametrize(
    ("tokens", "num", "k", "hidden", "inter", "limit", "dtype", "config"),
    [
        (1, 8, 2, 64, 32, None, torch.float32, GroupedConfig(16, 16, 32, 4, 2)),
        (7, 6, 2, 48, 40, 0.5, torch.float32, GroupedConfig(16, 16, 16, 4, 2)),  # ragged tiles
        (40, 4, 3, 32, 48, None, torch.float16, GroupedConfig(32, 32, 16, 4, 2)),
        (70, 5, 1, 32, 16, 0.3, torch.float32, GroupedConfig(64, 16, 32, 4, 2)),
        (12, 16, 4, 32, 32, None, torch.float32, None),  # the default tiles
    ],
)
def test_the_kernels_give_the_torch_reference(
    kind, tokens, num, k, hidden, inter, limit, dtype, config
):
    experts = _experts(num, hidden, inter, limit, dtype, seed=tokens, kind=kind)
    weights, ids = _routing(tokens, num, k, seed=tokens)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    # the reference in float32 on the same (for 16-bit data: rounded) weights and inputs
    want = copy.deepcopy(experts).float().reference(x.float(), weights, ids)
    with torch.no_grad():
        got = grouped_experts(x, weights, ids, *experts.kernel_weights(), config)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert want.abs().max() > 0.05  # the experts did contribute


def test_prefill_runs_in_launches_of_bounded_pair_outputs(monkeypatch):
    experts = _experts(4, 32, 16, None, torch.float32)
    weights, ids = _routing(21, 4, 2)
    x = torch.randn(21, 32, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    args = (x, weights, ids, *experts.kernel_weights(), GroupedConfig(16, 16, 16, 4, 2))
    with torch.no_grad():
        want = grouped_experts(*args)
        monkeypatch.setattr(grouped, "PAIR_BYTES", 8 * 2 * 32 * 4)  # float32: 8, 8, 5 tokens
        got = grouped_experts(*args)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got, experts.reference(x, weights, ids), rtol=1e-5, atol=1e-6)


def test_bad_inputs_are_named():
    experts = _experts(4, 32, 16, None, torch.float32)
    gate_up, down = experts.gate_up_proj.data, experts.down_proj.data
    weights, ids = _routing(3, 4, 2)
    x = torch.randn(3, 32, device=DEVICE)
    stacked = ExpertWeights(gate_up, down)
    want = r"grouped_experts: gate_up must be \[E, 2I, D\] = \(4, 32, 32\) torch.float16 .* got "
    with pytest.raises(ValueError, match=want + r"\(4, 32, 32\) torch.float32"):
        grouped_experts(x.half(), weights, ids, stacked)
    with pytest.raises(ValueError, match=r"weights must be \(3, 2\), got \(3, 3\)"):
        grouped_experts(x, torch.ones(3, 3, device=DEVICE), ids, stacked)
    with pytest.raises(ValueError, match=r"ids must be \[3, k\] integer, got \(3, 2\) "
                                         r"torch.float32"):  # fmt: skip
        grouped_experts(x, weights, ids.float(), stacked)
    with pytest.raises(ValueError, match=r"down must be \[E, D, I\] = \(4, 32, 16\)"):
        grouped_experts(x, weights, ids, ExpertWeights(gate_up, down.transpose(1, 2)))
    with pytest.raises(ValueError, match=r"gate_up must be \[E, D, 2I\] = \(4, 32, 32\)"):
        grouped_experts(x, weights, ids, ExpertWeights(gate_up[:, :24], down, interleaved=True))
    with pytest.raises(ValueError, match=r"down_bias must be \[4, 32\] contiguous, got \(4, 16\)"):
        grouped_experts(x, weights, ids, ExpertWeights(gate_up, down, down_bias=down[:, 0]))


def test_bad_ungated_inputs_are_named():
    stacked = _experts(4, 32, 16, None, torch.float32, kind="relu2").kernel_weights()[0]
    up, down = stacked.gate_up, stacked.down
    weights, ids = _routing(3, 4, 2)
    x, relu2 = torch.randn(3, 32, device=DEVICE), Activation(relu2=True)
    with pytest.raises(ValueError, match=r"relu2 \(ungated\) takes no limit or alpha, got "
                                         r"limit=7.0, alpha=None"):  # fmt: skip
        Activation(limit=7.0, relu2=True)
    want = r"gate_up must be \[E, I, D\] = \(4, 16, 32\) torch.float32 .* got \(4, 16, 32\) "
    with pytest.raises(ValueError, match=want + "torch.float16"):
        grouped_experts(x, weights, ids, ExpertWeights(up.half(), down), relu2)
    with pytest.raises(ValueError, match=r"gate_up must be the up rows \[E, I, D\] "
                                         r"\(interleaved=False\)"):  # fmt: skip
        grouped_experts(x, weights, ids, ExpertWeights(up.mT, down.mT, interleaved=True), relu2)
    with pytest.raises(ValueError, match=r"gate_up_bias must be \[4, 16\] contiguous"):
        grouped_experts(x, weights, ids, ExpertWeights(up, down, up[:, :, 0].repeat(1, 2)), relu2)


def test_ungated_experts_take_biases():
    gen = torch.Generator().manual_seed(3)
    up, down = torch.randn(5, 24, 32, generator=gen) / 6, torch.randn(5, 32, 24, generator=gen) / 5
    up_bias, down_bias = torch.randn(5, 24, generator=gen), torch.randn(5, 32, generator=gen)
    weights, ids = _routing(9, 5, 2, seed=3)
    x = torch.randn(9, 32, generator=gen)
    stacked = ExpertWeights(*(t.to(DEVICE) for t in (up, down, up_bias, down_bias)))
    got = grouped_experts(x.to(DEVICE), weights, ids, stacked, Activation(relu2=True),
                          GroupedConfig(16, 16, 16, 4, 2)).cpu()  # fmt: skip
    want = torch.zeros_like(x)
    for t, (w, e) in enumerate(zip(weights.cpu().tolist(), ids.cpu().tolist(), strict=True)):
        for weight, expert in zip(w, e, strict=True):
            hidden = torch.relu(up[expert] @ x[t] + up_bias[expert]).square()
            want[t] += weight * (down[expert] @ hidden + down_bias[expert])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("tokens", "k", "hidden"), [(1, 1, 16), (5, 3, 48), (3, 8, 1500)])
def test_the_pair_sum_adds_each_tokens_rows_in_choice_order(tokens, k, hidden):
    # float16 rows whose float32 sum is exact in this order and rounds once at the end
    gen = torch.Generator().manual_seed(k)
    pairs = (torch.randn(tokens * k, hidden, generator=gen) * 4).to(DEVICE, torch.float16)
    got = grouped.sum_pairs(pairs, k)
    want = pairs.double().view(tokens, k, hidden).sum(1)
    assert got.dtype == torch.float16 and got.shape == (tokens, hidden)
    torch.testing.assert_close(got.double(), want.to(torch.float16).double(), rtol=0, atol=0)


def test_the_invariant_configuration_is_one_for_every_batch_and_fits():
    assert grouped.invariant_config(2) == grouped.default_config(10**6, 1, 2)
    assert grouped.invariant_config(4).block_k < grouped.invariant_config(2).block_k
    for size in (2, 4):
        cfg = grouped.invariant_config(size)
        assert grouped._pipeline_bytes(cfg, size) <= grouped.SHARED_BYTES
