"""The (token, choice) pairs of a mixture of experts sorted by expert on the device, in blocks
of slots of one expert each: what the grouped experts kernels (`kernels/moe/grouped_experts.py`) run
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
PAIRS_PER_PROGRAM = 1024  # the parallel sort's pairs per program (prefill)


def expert_blocks(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """`ids [T, k]` (each token's chosen experts, in `[0, num_experts)`) sorted into blocks, with
    no host sync: every shape follows from `ids.shape`.

    Up to `SORT_IN_ONE_PROGRAM` pairs (decode) one program sorts them, keeping each expert's
    pairs in order. More (prefill) take three launches: each pair's rank among its expert's by
    an atomic counter, each expert's first slot and the blocks' experts, then the pairs placed.
    The order of an expert's pairs then follows the atomics, which changes no result: the
    kernels compute each slot's row on its own."""
    pairs, device = ids.numel(), ids.device
    size = -(-(pairs + min(num_experts, pairs) * (block_m - 1)) // block_m) * block_m
    slots = torch.empty(size, dtype=torch.int32, device=device)
    block_expert = torch.empty(size // block_m, dtype=torch.int32, device=device)
    flat, experts = ids.reshape(-1), triton.next_power_of_2(num_experts)
    if pairs <= SORT_IN_ONE_PROGRAM:
        expert_blocks_kernel[(1,)](
            flat, slots, block_expert, pairs, num_experts, size, BLOCK_M=block_m,
            EXPERTS=experts, num_warps=4,
        )  # fmt: skip
        return ExpertBlocks(slots, block_expert, pairs, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    rank = torch.empty(pairs, dtype=torch.int32, device=device)
    starts = torch.empty(num_experts, dtype=torch.int32, device=device)
    grid = (triton.cdiv(pairs, PAIRS_PER_PROGRAM),)
    rank_pairs_kernel[grid](flat, counts, rank, pairs, BLOCK=PAIRS_PER_PROGRAM)
    block_layout_kernel[(1,)](
        counts, starts, slots, block_expert, pairs, num_experts, size, BLOCK_M=block_m,
        EXPERTS=experts, num_warps=4,
    )  # fmt: skip
    place_pairs_kernel[grid](flat, rank, starts, slots, pairs, BLOCK=PAIRS_PER_PROGRAM)
    return ExpertBlocks(slots, block_expert, pairs, block_m)


@triton.jit
def rank_pairs_kernel(ids_ptr, counts_ptr, rank_ptr, num_pairs, BLOCK: tl.constexpr):
    """Each pair's rank among its expert's pairs (an atomic counter per expert)."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    expert = tl.load(ids_ptr + p, mask=p < num_pairs, other=0).to(tl.int32)
    rank = tl.atomic_add(counts_ptr + expert, 1, mask=p < num_pairs)
    tl.store(rank_ptr + p, rank, mask=p < num_pairs)


@triton.jit
def block_layout_kernel(
    counts_ptr,  # [E] int32: pairs per expert
    starts_ptr,  # [E] int32 out: each expert's first slot
    slots_ptr,  # [S] int32 out: all padding (`num_pairs`) until the pairs are placed
    block_expert_ptr,  # [S / BLOCK_M] int32 out
    num_pairs,
    num_experts,
    num_slots,
    BLOCK_M: tl.constexpr,
    EXPERTS: tl.constexpr,  # a power of two >= num_experts
):
    e = tl.arange(0, EXPERTS)
    counts = tl.load(counts_ptr + e, mask=e < num_experts, other=0)
    starts, ends = _expert_slots(counts, BLOCK_M)
    tl.store(starts_ptr + e, starts, mask=e < num_experts)
    _fill_and_own(ends, slots_ptr, block_expert_ptr, num_pairs, num_experts, num_slots, BLOCK_M)


@triton.jit
def place_pairs_kernel(ids_ptr, rank_ptr, starts_ptr, slots_ptr, num_pairs, BLOCK: tl.constexpr):
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    expert = tl.load(ids_ptr + p, mask=p < num_pairs, other=0).to(tl.int32)
    slot = tl.load(starts_ptr + expert, mask=p < num_pairs, other=0)
    slot += tl.load(rank_ptr + p, mask=p < num_pairs, other=0)
    tl.store(slots_ptr + slot, p, mask=p < num_pairs)


@triton.jit
def _expert_slots(counts, BLOCK_M: tl.constexpr):
    """Each expert's first slot and the slot after its last: its pairs padded to whole blocks,
    the experts one after another."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    return ends - padded, ends


@triton.jit
def _fill_and_own(ends, slots_ptr, block_expert_ptr, num_pairs, num_experts, num_slots,
                  BLOCK_M: tl.constexpr, CHUNK: tl.constexpr = 32):  # fmt: skip
    """Every slot padding; each block's expert: how many experts end at or before its start
    (-1 past the last)."""
    for s0 in range(0, num_slots, 1024):
        s = s0 + tl.arange(0, 1024)
        tl.store(slots_ptr + s, num_pairs, mask=s < num_slots)
    for b0 in range(0, num_slots // BLOCK_M, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        owner = tl.sum((ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(owner < num_experts, owner, -1),
                 mask=b < num_slots // BLOCK_M)  # fmt: skip


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
    """One program: counts per expert, each expert's first slot, the padding and the blocks'
    experts, then the pairs placed chunk by chunk (a pair's rank among its expert's pairs:
    those in earlier chunks plus a running sum in its chunk)."""
    e = tl.arange(0, EXPERTS)
    counts = tl.zeros((EXPERTS,), dtype=tl.int32)
    for p0 in range(0, num_pairs, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        expert = tl.load(ids_ptr + p, mask=p < num_pairs, other=EXPERTS).to(tl.int32)
        counts += tl.sum((expert[:, None] == e[None, :]).to(tl.int32), axis=0)
    starts, ends = _expert_slots(counts, BLOCK_M)
    _fill_and_own(ends, slots_ptr, block_expert_ptr, num_pairs, num_experts, num_slots, BLOCK_M)
    tl.debug_barrier()  # the padding is written before the pairs overwrite their slots
    seen = tl.zeros((EXPERTS,), dtype=tl.int32)
    for p0 in range(0, num_pairs, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        expert = tl.load(ids_ptr + p, mask=p < num_pairs, other=EXPERTS).to(tl.int32)
        mine = (expert[:, None] == e[None, :]).to(tl.int32)  # [CHUNK, EXPERTS]
        slot = starts[None, :] + seen[None, :] + tl.cumsum(mine, axis=0) - 1
        tl.store(slots_ptr + tl.sum(mine * slot, axis=1), p, mask=p < num_pairs)
        seen += tl.sum(mine, axis=0)


__all__ = ["SORT_IN_ONE_PROGRAM", "ExpertBlocks", "expert_blocks"]
