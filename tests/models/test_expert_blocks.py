"""The sort of a mixture's (token, choice) pairs into blocks of one expert each
(`kernels/moe/expert_blocks.py`; CPU: the interpreter), by its one Triton program (decode) and
by its three parallel launches (prefill)."""

from __future__ import annotations

import pytest
import torch

from unified_attn.kernels.moe import expert_blocks as sorting
from unified_attn.kernels.moe.expert_blocks import expert_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _ids(tokens: int, num: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(num, generator=gen)[:k] for _ in range(tokens)]).to(DEVICE)


@pytest.mark.parametrize("sort", ["one program", "parallel"])
@pytest.mark.parametrize(("tokens", "num", "k", "block_m"), [(1, 8, 2, 16), (9, 4, 3, 4),
                                                              (33, 64, 8, 16), (5, 3, 3, 2),
                                                              (20, 40, 3, 8)])  # fmt: skip
def test_blocks_hold_every_pair_once_in_blocks_of_one_expert(monkeypatch, sort, tokens, num, k,
                                                             block_m):  # fmt: skip
    if sort == "parallel":
        monkeypatch.setattr(sorting, "SORT_IN_ONE_PROGRAM", 0)
    ids = _ids(tokens, num, k, seed=tokens)
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


def test_both_sorts_give_the_same_blocks(monkeypatch):
    ids = _ids(700, 12, 4, seed=3)  # 2,800 pairs: several programs of the parallel sort
    monkeypatch.setattr(sorting, "PAIRS_PER_PROGRAM", 512)
    one = expert_blocks(ids, 12, 8)
    monkeypatch.setattr(sorting, "SORT_IN_ONE_PROGRAM", 0)
    other = expert_blocks(ids, 12, 8)
    assert torch.equal(one.block_expert, other.block_expert)
    # the parallel sort's order within an expert follows its atomics: the same pairs per expert
    for expert in range(12):
        mine = (one.block_expert == expert).repeat_interleave(8)
        assert sorted(other.slots[mine].tolist()) == sorted(one.slots[mine].tolist())
