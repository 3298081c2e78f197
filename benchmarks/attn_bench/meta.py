"""Our side of a launch: the batch's metadata (a random block table, the split-KV plan and its
pre-sized scratch) and the Triton kernel call over it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from common import HEAD, HKV, HQ, PAGE

from .config import DTYPE, SCALE


@dataclasses.dataclass
class Meta:
    """Device-side batch description for ours, plus the split plan."""

    lens: list[int]
    q_lens: list[int]
    qsl: torch.Tensor
    seq_lens: torch.Tensor
    bt: torch.Tensor  # [B, max_blocks] int32, physical block ids
    nblk: list[int]
    max_q: int
    plan: Any
    scratch: Any

    @property
    def B(self) -> int:
        return len(self.lens)

    @property
    def T(self) -> int:
        return sum(self.q_lens)


def make_meta(
    lens: Sequence[int], q_lens: Sequence[int], perm: torch.Tensor, dev: torch.device
) -> Meta:
    """Block table from the permutation `perm` (random physical ids), metadata, split plan."""
    from unified_attn.backend import CommonAttentionMetadata
    from unified_attn.backends.triton.backend import TritonAttentionBackend
    from unified_attn.backends.triton.ops import SplitScratch

    lens, q_lens = list(lens), list(q_lens)
    nblk = [-(-n // PAGE) for n in lens]
    if sum(nblk) > perm.numel():
        raise ValueError(f"{sum(nblk)} blocks needed, {perm.numel()} in the cache")
    bt = torch.zeros(len(lens), max(nblk), dtype=torch.int32)
    pos = 0
    for i, n in enumerate(nblk):
        bt[i, :n] = perm[pos : pos + n]
        pos += n
    qsl_cpu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl_cpu[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    sl_cpu = torch.tensor(lens, dtype=torch.int32)
    positions = torch.cat(
        [torch.arange(n - q, n, dtype=torch.int64) for n, q in zip(lens, q_lens, strict=True)]
    )
    common = CommonAttentionMetadata(
        query_start_loc=qsl_cpu.to(dev),
        query_start_loc_cpu=qsl_cpu,
        seq_lens=sl_cpu.to(dev),
        seq_lens_cpu=sl_cpu,
        num_computed_tokens_cpu=sl_cpu - torch.tensor(q_lens, dtype=torch.int32),
        positions=positions.to(dev),
        num_reqs=len(lens),
        num_actual_tokens=sum(q_lens),
        max_query_len=max(q_lens),
        max_seq_len=max(lens),
        slot_mappings={},
    )
    backend = TritonAttentionBackend(num_kv_heads=HKV, head_size=HEAD, dtype=DTYPE)
    plan = backend.plan_split(common)
    scratch = SplitScratch()
    if plan is not None:  # pre-size outside the timed region
        scratch.ensure(rows=sum(q_lens) * HQ, segments=plan.num_segments, head_pad=HEAD, device=dev)
    return Meta(
        lens=lens,
        q_lens=q_lens,
        qsl=common.query_start_loc,
        seq_lens=common.seq_lens,
        bt=bt.to(dev),
        nblk=nblk,
        max_q=max(q_lens),
        plan=plan,
        scratch=scratch,
    )


def plan_dict(plan: Any) -> dict[str, int] | None:
    return None if plan is None else {"num_segments": plan.num_segments, "segment": plan.segment}


def ours_fn(
    q: torch.Tensor,
    cache: torch.Tensor,
    out: torch.Tensor,
    meta: Meta,
    *,
    use_plan: bool = True,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> Callable[[], torch.Tensor]:
    from unified_attn.backends.triton.ops import unified_attention

    k_cache, v_cache = cache[:, 0], cache[:, 1]
    plan = meta.plan if use_plan else None

    def call() -> torch.Tensor:
        return unified_attention(
            q,
            k_cache,
            v_cache,
            out,
            query_start_loc=meta.qsl,
            seq_lens=meta.seq_lens,
            block_table=meta.bt,
            num_seqs=meta.B,
            max_query_len=meta.max_q,
            scale=SCALE,
            causal=True,
            window=window,
            soft_cap=soft_cap,
            sinks=sinks,
            split=plan,
            scratch=meta.scratch,
        )

    return call
