"""The kernels of the expert pair sort (jit code only; the launcher is `expert_blocks.py`)."""

import triton
import triton.language as tl


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
