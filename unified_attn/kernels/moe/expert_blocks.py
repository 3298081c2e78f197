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

from unified_attn.kernels.moe.expert_blocks_jit import (
    block_layout_kernel,
    expert_blocks_kernel,
    place_pairs_kernel,
    rank_pairs_kernel,
)


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


__all__ = ["SORT_IN_ONE_PROGRAM", "ExpertBlocks", "expert_blocks"]
