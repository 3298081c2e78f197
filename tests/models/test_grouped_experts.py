"""The grouped experts kernels (`models/grouped_experts.py`; CPU: the interpreter) against the
dense reference `RoutedExperts.reference`, which the HF parity tests check against transformers;
and the sort of (token, choice) pairs into one-expert blocks that they run on."""

from __future__ import annotations

import copy

import pytest
import torch

from unified_attn.models import grouped_experts as grouped
from unified_attn.models.grouped_experts import GroupedConfig, expert_blocks, grouped_experts
from unified_attn.models.moe import RoutedExperts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _experts(num: int, hidden: int, inter: int, limit: float | None, dtype: torch.dtype,
             seed: int = 0) -> RoutedExperts:  # fmt: skip
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
def test_the_kernels_give_the_dense_reference(tokens, num, k, hidden, inter, limit, dtype, config):
    experts = _experts(num, hidden, inter, limit, dtype, seed=tokens)
    weights, ids = _routing(tokens, num, k, seed=tokens)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    # the reference in float32 on the same (for 16-bit data: rounded) weights and inputs
    want = copy.deepcopy(experts).float().reference(x.float(), weights, ids)
    got = grouped_experts(x, weights, ids, experts.gate_up_proj.data, experts.down_proj.data,
                          limit, config)  # fmt: skip
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert want.abs().max() > 0.05  # the experts did contribute


def test_prefill_runs_in_launches_of_bounded_pair_outputs(monkeypatch):
    experts = _experts(4, 32, 16, None, torch.float32)
    weights, ids = _routing(21, 4, 2)
    x = torch.randn(21, 32, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    args = (x, weights, ids, experts.gate_up_proj.data, experts.down_proj.data, None,
            GroupedConfig(16, 16, 16, 4, 2))  # fmt: skip
    want = grouped_experts(*args)
    monkeypatch.setattr(
        grouped, "PAIR_BYTES", 8 * 2 * 32 * 4
    )  # float32: 8 tokens a launch: 8, 8, 5
    got = grouped_experts(*args)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got, experts.reference(x, weights, ids), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sort", ["one program", "torch"])
@pytest.mark.parametrize(("tokens", "num", "k", "block_m"), [(1, 8, 2, 16), (9, 4, 3, 4),
                                                              (33, 64, 8, 16), (5, 3, 3, 2),
                                                              (20, 40, 3, 8)])  # fmt: skip
def test_blocks_hold_every_pair_once_in_blocks_of_one_expert(monkeypatch, sort, tokens, num, k,
                                                             block_m):  # fmt: skip
    if sort == "torch":
        monkeypatch.setattr(grouped, "SORT_IN_ONE_PROGRAM", 0)
    _, ids = _routing(tokens, num, k, seed=tokens)
    blocks = expert_blocks(ids, num, block_m)
    pairs = tokens * k
    slots, owner = blocks.slots.cpu().long(), blocks.block_expert.cpu().long()
    assert len(slots) == len(owner) * block_m <= pairs + min(num, pairs) * block_m
    real = slots[slots < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # every pair once
    flat = ids.reshape(-1).cpu()
    for block, expert in enumerate(owner.tolist()):
        held = slots[block * block_m : (block + 1) * block_m]
        held = held[held < pairs]
        if expert < 0:
            assert len(held) == 0  # blocks past the last expert's hold nothing
        else:
            assert len(held) > 0 and (flat[held] == expert).all()
    used = owner[owner >= 0]
    assert (used[1:] >= used[:-1]).all()  # experts in order
    assert sorted(set(used.tolist())) == sorted(set(flat.tolist()))  # only chosen experts


def test_bad_inputs_are_named():
    experts = _experts(4, 32, 16, None, torch.float32)
    gate_up, down = experts.gate_up_proj.data, experts.down_proj.data
    weights, ids = _routing(3, 4, 2)
    x = torch.randn(3, 32, device=DEVICE)
    want = r"grouped_experts: gate_up must be \[E, 2I, 32\] torch.float16 .* got \(4, 32, 32\) "
    with pytest.raises(ValueError, match=want + "torch.float32"):
        grouped_experts(x.half(), weights, ids, gate_up, down)
    with pytest.raises(ValueError, match=r"weights must be \(3, 2\), got \(3, 3\)"):
        grouped_experts(x, torch.ones(3, 3, device=DEVICE), ids, gate_up, down)
    with pytest.raises(ValueError, match=r"ids must be \[3, k\] integer, got \(3, 2\) "
                                         r"torch.float32"):  # fmt: skip
        grouped_experts(x, weights, ids.float(), gate_up, down)
    with pytest.raises(ValueError, match=r"down must be \[4, 32, 16\]"):
        grouped_experts(x, weights, ids, gate_up, down.transpose(1, 2))


def test_both_sorts_give_the_same_blocks(monkeypatch):
    _, ids = _routing(50, 12, 4, seed=3)  # 200 pairs: several chunks of the one program's loops
    one = expert_blocks(ids, 12, 8)
    monkeypatch.setattr(grouped, "SORT_IN_ONE_PROGRAM", 0)
    other = expert_blocks(ids, 12, 8)
    assert torch.equal(one.slots, other.slots) and torch.equal(one.block_expert, other.block_expert)
