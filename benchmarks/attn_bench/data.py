"""Random inputs: bf16 tensors, the paged KV cache, skewed batch lengths, and the cache's pages
copied into the dense layouts that the peers read."""

from __future__ import annotations

import itertools
import random
import statistics
from collections.abc import Sequence
from typing import Any

import torch
from common import HEAD, HKV, PAGE

from .config import DTYPE, ELT, GIB


def randn(*shape: int, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="cuda").normal_()


def rand_cache(num_blocks: int) -> torch.Tensor:
    """KV cache `[num_blocks, 2, PAGE, HKV, HEAD]`: `cache[:, 0]` is K, `cache[:, 1]` V."""
    return randn(num_blocks, 2, PAGE, HKV, HEAD)


def blocks_of(lens: Sequence[int]) -> int:
    return sum(-(-n // PAGE) for n in lens)


def skewed_lengths(batch: int, ctx: int, rng: random.Random, sigma: float = 1.5) -> list[int]:
    """Lognormal lengths with the same total as `batch * ctx`: a few requests are long."""
    if batch == 1:
        return [ctx]
    total, lo, cap = batch * ctx, PAGE, max(ctx, min(8 * ctx, 131072))
    w = [rng.lognormvariate(0.0, sigma) for _ in range(batch)]
    lens = [x / sum(w) * total for x in w]
    for _ in range(100):
        lens = [min(max(x, lo), cap) for x in lens]
        excess = total - sum(lens)
        movable = [i for i, x in enumerate(lens) if (lo < x < cap)]
        if abs(excess) < 0.5 or not movable:
            break
        s = sum(lens[i] for i in movable)
        for i in movable:
            lens[i] += excess * lens[i] / s
    out = [round(x) for x in lens]
    diff = total - sum(out)
    order = sorted(range(batch), key=lambda i: -out[i])
    for i in itertools.cycle(order):
        if diff == 0:
            break
        step = 1 if diff > 0 else -1
        if lo <= out[i] + step <= cap:
            out[i] += step
            diff -= step
    return out


def lens_stats(lens: Sequence[int]) -> dict[str, Any]:
    return {
        "n": len(lens),
        "total": sum(lens),
        "min": min(lens),
        "median": statistics.median(lens),
        "max": max(lens),
    }


def dense_kv(cache: torch.Tensor, bt: torch.Tensor, length: int) -> tuple[torch.Tensor, ...]:
    """Contiguous k, v `[B, HKV, length, HEAD]` gathered from the paged cache (uniform lengths)."""
    batch, nblk = bt.shape[0], -(-length // PAGE)
    k = torch.empty(batch, HKV, length, HEAD, dtype=DTYPE, device=cache.device)
    v = torch.empty_like(k)
    rows = max(1, GIB // (nblk * PAGE * HKV * HEAD * ELT))
    for s in range(0, batch, rows):
        idx = bt[s : s + rows, :nblk].long()
        for which, dst in ((0, k), (1, v)):
            blocks = cache[idx, which]  # [r, nblk, PAGE, HKV, HEAD]
            r = blocks.shape[0]
            dst[s : s + r] = blocks.reshape(r, nblk * PAGE, HKV, HEAD)[:, :length].transpose(1, 2)
    return k, v


def flex_paged_kv(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same pages in FlexAttention's paged layout `[1, HKV, num_blocks * PAGE, HEAD]`
    (physical token index = block id * PAGE + offset, as in torch's PagedAttention)."""
    nb = cache.shape[0]
    k = cache[:, 0].permute(2, 0, 1, 3).reshape(1, HKV, nb * PAGE, HEAD)
    v = cache[:, 1].permute(2, 0, 1, 3).reshape(1, HKV, nb * PAGE, HEAD)
    return k.contiguous(), v.contiguous()
