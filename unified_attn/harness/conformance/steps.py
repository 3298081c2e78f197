"""A cell's steps, shared by the backend and the oracle: `Step`, random non-contiguous block
tables (`random_table`, `null_unneeded_blocks`), `make_step` and `make_steps` (history, then the
cell's batch), and `encoder_step` (an encoder pass: no slots, no block table). Everything is
keyed by the KV-cache group `GROUP_ID`."""

from __future__ import annotations

import attrs
import torch

from unified_attn.backend import CommonAttentionMetadata
from unified_attn.harness.conformance.cells import Cell
from unified_attn.utils import cdiv

GROUP_ID = 3  # not 0: backends must key everything by the group they are given


@attrs.frozen
class Step:
    """One step's inputs, shared by the backend and the oracle."""

    common: CommonAttentionMetadata
    block_table: torch.Tensor | None  # [B, max_blocks] int32; None: no cache (encoder pass)
    query: torch.Tensor  # [T, Hq * D]
    key: torch.Tensor  # [T, Hkv * D] (cross-attention: [E, Hkv * D], the encoder rows written)
    value: torch.Tensor
    requests: tuple[int, ...]  # the cell's request index of every row


def random_table(counts: list[int], gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """`counts[i]` random, non-contiguous block ids (never the null block 0) for request i, one
    spare column of nulls; the block count."""
    num_blocks = sum(counts) + 8
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(counts), max(counts) + 1, dtype=torch.int32)
    for i, count in enumerate(counts):
        table[i, :count] = torch.tensor(ids[:count], dtype=torch.int32)
        ids = ids[count:]
    return table, num_blocks


def null_unneeded_blocks(cell: Cell, table: torch.Tensor) -> torch.Tensor:
    """Blocks before the first key any new query may see -> the null block (as managers do);
    the blocks of StreamingLLM's sink tokens stay."""
    table = table.clone()
    kept = -(-cell.sink_tokens // cell.block_size)
    for i, computed in enumerate(cell.computed):
        first_needed = 0
        if cell.sliding_window is not None:
            first_needed = max(0, computed - cell.sliding_window + 1)
        if cell.chunk_size is not None:
            first_needed = computed // cell.chunk_size * cell.chunk_size
        table[i, kept : max(kept, first_needed // cell.block_size)] = 0
    return table


def batch_metadata(
    start: list[int],
    end: list[int],
    rows: list[int],
    slot_mappings: dict[int, torch.Tensor],
    device: str,
    block_sizes: dict[int, int] | None = None,
) -> CommonAttentionMetadata:
    """The metadata of requests `rows`, each with tokens `[start[i], end[i])` new."""
    lens = torch.tensor([end[i] - start[i] for i in rows], dtype=torch.int32)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).int()])
    seq_lens = torch.tensor([end[i] for i in rows], dtype=torch.int32)
    positions = torch.cat([torch.arange(start[i], end[i]) for i in rows])
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens.to(device),
        seq_lens_cpu=seq_lens,
        num_computed_tokens_cpu=torch.tensor([start[i] for i in rows], dtype=torch.int32),
        positions=positions.to(device),
        num_reqs=len(rows),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=int(lens.max()),
        max_seq_len=int(seq_lens.max()),
        slot_mappings=slot_mappings,
        block_sizes=block_sizes or {},
    )


def make_step(
    cell: Cell,
    table: torch.Tensor,
    start: list[int],
    end: list[int],
    kv: list[torch.Tensor],
    gen: torch.Generator,
    device: str,
) -> Step:
    """Requests with tokens `[start[i], end[i])` new; `kv[i] [2, S_i, Hkv, D]` their K/V."""
    bs, rows = cell.block_size, [i for i in range(len(start)) if end[i] > start[i]]
    positions = torch.cat([torch.arange(start[i], end[i]) for i in rows])
    owners = torch.cat([torch.full((end[i] - start[i],), i) for i in rows])
    slots = table[owners, positions // bs].long() * bs + positions % bs
    common = batch_metadata(start, end, rows, {GROUP_ID: slots.to(device)}, device)
    k = torch.cat([kv[i][0, start[i] : end[i]] for i in rows]).flatten(1)
    v = torch.cat([kv[i][1, start[i] : end[i]] for i in rows]).flatten(1)
    query = torch.randn(len(positions), cell.num_heads * cell.head_size, generator=gen)
    q, k, v = (t.to(device, cell.dtype) for t in (query, k, v))
    return Step(common, table[rows].to(device), q, k, v, tuple(rows))


def make_steps(cell: Cell, device: str, seed: int) -> tuple[list[Step], int]:
    """The history step (the computed tokens) and the cell's step; the block count."""
    gen = torch.Generator().manual_seed(seed)
    counts = [cdiv(c + n, cell.block_size) for c, n in zip(cell.computed, cell.new, strict=True)]
    table, num_blocks = random_table(counts, gen)
    kv = [
        torch.randn(2, c + n, cell.num_kv_heads, cell.head_size, generator=gen)
        for c, n in zip(cell.computed, cell.new, strict=True)
    ]
    for i, computed in enumerate(cell.computed):  # fp8 saturation cells: louder new tokens
        kv[i][:, computed:] *= cell.new_kv_gain
    total = [c + n for c, n in zip(cell.computed, cell.new, strict=True)]
    steps = [
        make_step(
            cell, null_unneeded_blocks(cell, table), list(cell.computed), total, kv, gen, device
        )
    ]
    if any(cell.computed):
        history = make_step(cell, table, [0] * len(total), list(cell.computed), kv, gen, device)
        steps.insert(0, history)
    return steps, num_blocks


def encoder_step(cell: Cell, device: str, seed: int) -> Step:
    """An encoder pass: every request's whole input packed, positions from 0, no slots."""
    gen = torch.Generator().manual_seed(seed)
    rows = list(range(len(cell.new)))
    common = batch_metadata([0] * len(rows), list(cell.new), rows, {}, device)
    num_tokens = sum(cell.new)
    query = torch.randn(num_tokens, cell.num_heads * cell.head_size, generator=gen)
    kv = torch.randn(2, num_tokens, cell.num_kv_heads * cell.head_size, generator=gen)
    q, k, v = (t.to(device, cell.dtype) for t in (query, kv[0], kv[1]))
    return Step(common, None, q, k, v, tuple(rows))
