"""The fp32 reference (small shapes only) and the check of our kernel against it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from common import HEAD, HKV, HQ

from .config import QPK, SCALE
from .data import blocks_of, rand_cache, randn
from .meta import Meta, make_meta, ours_fn, plan_dict
from .run import Run, err_str
from .timing import rel_err


def reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: Meta,
    *,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    qsl = meta.qsl.tolist()
    bt = meta.bt.long()
    for i, seq_len in enumerate(meta.lens):
        s, e = qsl[i], qsl[i + 1]
        blocks = bt[i, : meta.nblk[i]]
        k = cache[blocks, 0].reshape(-1, HKV, HEAD)[:seq_len].float()
        v = cache[blocks, 1].reshape(-1, HKV, HEAD)[:seq_len].float()
        k = k.repeat_interleave(QPK, dim=1)
        v = v.repeat_interleave(QPK, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q[s:e].float(), k) * SCALE
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = torch.arange(seq_len - (e - s), seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if window:
            allowed &= q_pos - k_pos < window
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        if sinks is not None:
            col = sinks.float()[:, None, None].expand(HQ, e - s, 1)
            probs = torch.softmax(torch.cat([scores, col], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[s:e] = torch.einsum("hnl,lhd->nhd", probs, v)
    return out


def ref_check(
    run: Run,
    name: str,
    lens: Sequence[int],
    q_lens: Sequence[int],
    *,
    use_plan: bool = True,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Ours against the fp32 reference at a small shape (random block table)."""
    rec: dict[str, Any] = {"name": name, "lens": list(lens), "q_lens": list(q_lens)}
    try:
        nb = blocks_of(lens) + 3
        cache = rand_cache(nb)
        meta = make_meta(lens, q_lens, torch.randperm(nb, generator=run.gen), run.dev)
        rec["split"] = plan_dict(meta.plan) if use_plan else None
        q = randn(meta.T, HQ, HEAD)
        out = torch.empty_like(q)
        ours_fn(
            q, cache, out, meta, use_plan=use_plan, window=window, soft_cap=soft_cap, sinks=sinks
        )()
        ref = reference(q, cache, meta, window=window, soft_cap=soft_cap, sinks=sinks)
        rec["finite"] = bool(torch.isfinite(out).all())
        rec.update(rel_err(out, ref))
        rec["ok"] = rec["ok"] and rec["finite"]
    except Exception as e:
        rec.update(ok=False, error=err_str(e))
    status = "ok" if rec.get("ok") else "FAILED"
    run.log(f"check {name}: {status} rel err {rec.get('max_rel_err', float('nan')):.2e}")
    return rec
