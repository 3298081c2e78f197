"""Build a paged batch (cache, block tables, metadata) for backend tests."""

from __future__ import annotations

import attrs
import torch

from unified_attn.backend import CommonAttentionMetadata


@attrs.define
class PagedBatch:
    common: CommonAttentionMetadata
    block_table: torch.Tensor  # [B, max_blocks] int32
    k_full: list[torch.Tensor]  # per request: [seq_len, Hkv, D] every key of the sequence
    v_full: list[torch.Tensor]
    k_new: torch.Tensor  # [T, Hkv, D] keys of the new tokens, packed
    v_new: torch.Tensor


def make_batch(
    computed: list[int],
    new: list[int],
    *,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    num_blocks: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
) -> PagedBatch:
    """Requests with `computed[i]` cached tokens and `new[i]` new ones, on random blocks."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(computed, new, strict=True)]
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    needed = sum(-(-s // block_size) for s in seq_lens)
    assert needed < num_blocks, "not enough blocks for the batch"
    ids = (torch.randperm(num_blocks - 1, generator=gen)[:needed] + 1).tolist()  # skip null
    table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    k_full, v_full, k_new, v_new, slots, positions = [], [], [], [], [], []
    for i, (c, s) in enumerate(zip(computed, seq_lens, strict=True)):
        nb = -(-s // block_size)
        table[i, :nb] = torch.tensor(ids[:nb], dtype=torch.int32)
        ids = ids[nb:]
        k = torch.randn(s, num_kv_heads, head_size, generator=gen).to(dtype)
        v = torch.randn(s, num_kv_heads, head_size, generator=gen).to(dtype)
        k_full.append(k.to(device))
        v_full.append(v.to(device))
        k_new.append(k[c:])
        v_new.append(v[c:])
        pos = torch.arange(c, s)
        positions.append(pos)
        slots.append(table[i, pos // block_size].long() * block_size + pos % block_size)
    qsl = torch.tensor([0, *torch.cumsum(torch.tensor(new), 0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    positions_t = torch.cat(positions)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl,
        seq_lens=seq.to(device),
        seq_lens_cpu=seq,
        num_computed_tokens_cpu=torch.tensor(computed, dtype=torch.int32),
        positions=positions_t.to(device),
        num_reqs=len(seq_lens),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=max(new),
        max_seq_len=max(seq_lens),
        slot_mappings={0: torch.cat(slots).to(device)},
    )
    return PagedBatch(
        common,
        table.to(device),
        k_full,
        v_full,
        torch.cat(k_new).to(device),
        torch.cat(v_new).to(device),
    )


def fill_cached_tokens(cache: torch.Tensor, batch: PagedBatch, computed: list[int]) -> None:
    """Write the already-computed tokens' K/V into `cache [NB, 2, bs, H, D]`."""
    block_size = cache.shape[2]
    for i, c in enumerate(computed):
        pos = torch.arange(c)
        blocks = batch.block_table[i, pos // block_size].long().cpu()
        cache[blocks, 0, pos % block_size] = batch.k_full[i][:c].to(cache.device)
        cache[blocks, 1, pos % block_size] = batch.v_full[i][:c].to(cache.device)
