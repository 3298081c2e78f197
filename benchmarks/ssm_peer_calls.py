"""How vLLM 0.33's Mamba-2 ops are called by its own model code and metadata builders, for
`ssm_kernels.py`'s peers: the decode update with tied head dims, the chunk metadata of fresh
prefills, and `causal_conv1d_fn`'s precomputed program map."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch


def vllm_decode(peers: Any, inp: dict[str, Any], head_dim: int, state: int) -> Callable:
    """`selective_state_update` as vLLM's Mamba2 mixer calls it (head dims tied, stride 0)."""
    heads = inp["A"].shape[0]
    A = inp["A"][:, None, None].expand(heads, head_dim, state)
    dt = inp["dt"][:, :, None].expand(-1, -1, head_dim)
    D = inp["D"][:, None].expand(heads, head_dim)
    dt_bias = inp["dt_bias"][:, None].expand(heads, head_dim)
    out = torch.empty_like(inp["x"])

    def run(slots: torch.Tensor) -> torch.Tensor:
        peers.ssu.selective_state_update(
            inp["pool"], inp["x"], dt, A, inp["B"], inp["C"], D, dt_bias, dt_softplus=True,
            state_batch_indices=slots, dst_state_batch_indices=slots, out=out,
        )  # fmt: skip
        return out

    return run


def vllm_chunks(lengths: list[int], chunk: int) -> tuple[torch.Tensor, ...]:
    """cu_chunk_seqlens, seq_idx, last_chunk_indices of fresh requests (as vLLM's builder)."""
    starts, seq_idx, last, pos = [], [], [], 0
    for r, length in enumerate(lengths):
        for begin in range(0, length, chunk):
            starts.append(pos + begin)
            seq_idx.append(r)
        pos += length
        last.append(len(starts) - 1)
    as_i32 = dict(dtype=torch.int32, device="cuda")
    return (torch.tensor([*starts, pos], **as_i32), torch.tensor(seq_idx, **as_i32),
            torch.tensor(last, **as_i32))  # fmt: skip


def vllm_conv_metadata(qsl_cpu: torch.Tensor) -> SimpleNamespace:
    """What `compute_causal_conv1d_metadata` prepares for `causal_conv1d_fn` (BLOCK_M 8)."""
    nums = -(-qsl_cpu.diff() // 8)
    mlist = torch.repeat_interleave(torch.arange(len(nums)), nums).int()
    offsets = torch.cat([torch.arange(int(n)) for n in nums]).int()
    programs = max(1024, len(mlist)) * 2
    batch_ptr = torch.full((programs,), -1, dtype=torch.int32, device="cuda")
    offset_ptr = torch.full((programs,), -1, dtype=torch.int32, device="cuda")
    batch_ptr[: len(mlist)] = mlist.cuda()
    offset_ptr[: len(mlist)] = offsets.cuda()
    entry = {"nums": nums, "tot": int(nums.sum()), "mlist": mlist, "mlist_len": len(mlist),
             "offsetlist": offsets, "batch_ptr": batch_ptr,
             "token_chunk_offset_ptr": offset_ptr}  # fmt: skip
    return SimpleNamespace(nums_dict={8: entry}, batch_ptr=batch_ptr,
                           token_chunk_offset_ptr=offset_ptr)  # fmt: skip
