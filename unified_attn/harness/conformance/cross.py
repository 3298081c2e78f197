"""The steps of a cross-attention cell, built as the runner builds them (`_encoder_inputs`):
each request's cross blocks are random and non-contiguous; in the step a request is first
scheduled its encoder keys and values are the layer's key/value rows (`[E, Hkv * D]`, E = the
encoder tokens of the requests admitted in that step, in request order) and the group's slot
mapping is `[E]`; a step that admits nobody has E = 0 and reads everything from the cache."""

from __future__ import annotations

import attrs
import torch

from unified_attn.harness.conformance.cells import CrossCell
from unified_attn.harness.conformance.steps import GROUP_ID, Step, batch_metadata, random_table
from unified_attn.utils import cdiv


def make_cross_steps(
    cell: CrossCell, device: str, seed: int
) -> tuple[list[Step], list[torch.Tensor], int]:
    """The cell's steps, each request's encoder K/V (host `[2, S_i, Hkv, D]` in the cell's
    dtype: what the oracle attends over) and the block count."""
    gen = torch.Generator().manual_seed(seed)
    table, num_blocks = random_table([cdiv(n, cell.block_size) for n in cell.encoder], gen)
    kv = [
        torch.randn(2, n, cell.num_kv_heads, cell.head_size, generator=gen).to(cell.dtype)
        for n in cell.encoder
    ]
    done = [0] * len(cell.encoder)
    steps = []
    for new in cell.steps:
        steps.append(cross_step(cell, table, kv, done, new, gen, device))
        done = [d + n for d, n in zip(done, new, strict=True)]
    return steps, kv, num_blocks


def cross_step(
    cell: CrossCell,
    table: torch.Tensor,
    kv: list[torch.Tensor],
    done: list[int],
    new: tuple[int, ...],
    gen: torch.Generator,
    device: str,
) -> Step:
    """Decoder tokens `[done[i], done[i] + new[i])`; the encoders of requests seen first."""
    rows = [i for i, n in enumerate(new) if n]
    admitted = [i for i in rows if not done[i]]
    end = [d + n for d, n in zip(done, new, strict=True)]
    slots = encoder_slots(cell, table, admitted)
    common = batch_metadata(
        done, end, rows, {GROUP_ID: slots.to(device)}, device, {GROUP_ID: cell.block_size}
    )
    lens = torch.tensor([cell.encoder[i] for i in rows], dtype=torch.int32)
    common = attrs.evolve(common, encoder_seq_lens_cpu=lens, encoder_seq_lens=lens.to(device))
    empty = torch.zeros(2, 0, cell.num_kv_heads, cell.head_size, dtype=cell.dtype)
    k, v = torch.cat([empty, *(kv[i] for i in admitted)], dim=1).flatten(2).to(device)
    query = torch.randn(common.num_actual_tokens, cell.num_heads * cell.head_size, generator=gen)
    q = query.to(device, cell.dtype)
    return Step(common, table[rows].to(device), q, k, v, tuple(rows))


def encoder_slots(cell: CrossCell, table: torch.Tensor, admitted: list[int]) -> torch.Tensor:
    """`[E]` int64 slots of the admitted requests' encoder tokens, request after request."""
    none = torch.zeros(0, dtype=torch.long)
    positions = torch.cat([none, *(torch.arange(cell.encoder[i]) for i in admitted)])
    owners = torch.cat([none, *(torch.full((cell.encoder[i],), i) for i in admitted)])
    bs = cell.block_size
    return table[owners, positions // bs].long() * bs + positions % bs
