"""The (token, choice) pairs of a mixture of experts sorted by expert on the device, in blocks
of slots of one expert each: what the grouped experts kernels (`models/grouped_experts.py`) run
on.

Each expert's pairs are padded to a multiple of `block_m` slots, so every block belongs to one
expert. There are at most `T * k + min(E, T * k) * (block_m - 1)` slots, a bound that follows
from the shapes alone: no host sync, and a decode step captures the sort in its CUDA graph.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl


@attrs.frozen
class ExpertBlocks:
    """The (token, choice) pairs sorted by expert, in blocks of `block_m` slots of one expert.

    `slots [S]` int32: the pair `t * k + j` in each slot, `num_pairs` in a padding slot;
    `block_expert [S / block_m]` int32: each block's expert, -1 for blocks past the last one."""

    slots: torch.Tensor
    block_expert: torch.Tensor
    num_pairs: int
    block_m: int


SORT_IN_ONE_PROGRAM = 4096  # the most pairs `expert_blocks` sorts in one launch (decode)


def expert_blocks(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """`ids [T, k]` (each token's chosen experts, in `[0, num_experts)`) sorted into blocks, with
    no host sync: every shape follows from `ids.shape`. Pairs of one expert keep their order.
    Up to `SORT_IN_ONE_PROGRAM` pairs (decode) one program sorts them; more (prefill) take
    about 25 torch ops, whose launches do not matter beside the products."""
    pairs = ids.numel()
    size = -(-(pairs + min(num_experts, pairs) * (block_m - 1)) // block_m) * block_m
    if pairs > SORT_IN_ONE_PROGRAM:
        return _sorted_by_torch(ids, num_experts, block_m, size)
    slots = torch.empty(size, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(size // block_m, dtype=torch.int32, device=ids.device)
    expert_blocks_kernel[(1,)](
        ids.reshape(-1), slots, block_expert, pairs, num_experts, size,
        BLOCK_M=block_m, EXPERTS=triton.next_power_of_2(num_experts), num_warps=4,
    )  # fmt: skip
    return ExpertBlocks(slots, block_expert, pairs, block_m)


def _sorted_by_torch(ids: torch.Tensor, num_experts: int, block_m: int, size: int) -> ExpertBlocks:
    pairs, device = ids.numel(), ids.device
    flat = ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # pairs of expert 0 first, then expert 1, ...
    by_expert = flat[order]
    first = torch.cumsum(counts, 0) - counts  # each expert's first position in `order`
    rank = torch.arange(pairs, device=device) - first[by_expert]
    slots = torch.full((size,), pairs, dtype=torch.int32, device=device)
    slots[(ends - padded)[by_expert] + rank] = order.to(torch.int32)
    starts = torch.arange(0, size, block_m, device=device)
    owner = torch.searchsorted(ends, starts, right=True)  # the expert whose slots hold `starts`
    block_expert = torch.where(owner < num_experts, owner, -1).to(torch.int32)
    return ExpertBlocks(slots, block_expert, pairs, block_m)


@triton.jit
def expert_blocks_kernel(
    ids_ptr,  # [P] integer
    slots_ptr,  # [S] int32 out
    block_expert_ptr,  # [S / BLOCK_M] int32 out
    num_pairs,
    num_experts,
    num_slots,
    BLOCK_M: tl.constexpr,
    EXPERTS: tl.constexpr,  # a power of two >= num_experts
    CHUNK: tl.constexpr = 32,
):
    """One program: counts per expert, each expert's first slot, then the pairs placed chunk by
    chunk (a pair's rank among its expert's pairs: those in earlier chunks plus a running sum
    in its chunk), then each block's expert (how many experts end at or before its start)."""
    e = tl.arange(0, EXPERTS)
    counts = tl.zeros((EXPERTS,), dtype=tl.int32)
    for p0 in range(0, num_pairs, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        expert = tl.load(ids_ptr + p, mask=p < num_pairs, other=EXPERTS).to(tl.int32)
        counts += tl.sum((expert[:, None] == e[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    for s0 in range(0, num_slots, 1024):
        s = s0 + tl.arange(0, 1024)
        tl.store(slots_ptr + s, num_pairs, mask=s < num_slots)
    tl.debug_barrier()  # the padding is written before the pairs overwrite their slots
    seen = tl.zeros((EXPERTS,), dtype=tl.int32)
    for p0 in range(0, num_pairs, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        expert = tl.load(ids_ptr + p, mask=p < num_pairs, other=EXPERTS).to(tl.int32)
        mine = (expert[:, None] == e[None, :]).to(tl.int32)  # [CHUNK, EXPERTS]
        slot = starts[None, :] + seen[None, :] + tl.cumsum(mine, axis=0) - 1
        tl.store(slots_ptr + tl.sum(mine * slot, axis=1), p, mask=p < num_pairs)
        seen += tl.sum(mine, axis=0)
    for b0 in range(0, num_slots // BLOCK_M, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        owner = tl.sum((ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(owner < num_experts, owner, -1),
                 mask=b < num_slots // BLOCK_M)  # fmt: skip


__all__ = ["SORT_IN_ONE_PROGRAM", "ExpertBlocks", "expert_blocks"]
