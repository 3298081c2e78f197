"""The decode section: ours (uniform and skewed lengths, split plan) against SDPA and dense
FlexAttention on contiguous copies and paged FlexAttention on the same pages, in TB/s."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from common import HEAD, HKV, HQ

from .config import ELT, GIB, KV_BYTES_PER_TOKEN, MAX_KV_BYTES, QPK
from .data import blocks_of, dense_kv, flex_paged_kv, lens_stats, rand_cache, randn, skewed_lengths
from .meta import Meta, make_meta, ours_fn, plan_dict
from .peers import flex_allowed, flex_dense_decode_mask, flex_fn, flex_paged_decode_mask, sdpa_fn
from .records import best_peer, fmt_peer
from .reference import ref_check
from .run import Run, err_str
from .timing import cleanup, free_bytes, measure, rel_err, rotation_count


def decode_bytes(lens: Sequence[int]) -> int:
    return sum(lens) * KV_BYTES_PER_TOKEN + 2 * len(lens) * HQ * HEAD * ELT


def add_bw(run: Run, rec: dict[str, Any], nbytes: int, ours_ms: float | None) -> None:
    if "ms" not in rec:
        return
    rec["tb_s"] = nbytes / rec["ms"] / 1e9
    if run.copy_tb_s:
        rec["pct_of_copy"] = 100.0 * rec["tb_s"] / run.copy_tb_s
    if ours_ms:
        rec["ours_speedup"] = rec["ms"] / ours_ms  # > 1: ours is faster


def decode_shape(run: Run, batch: int, ctx: int, with_flex: bool) -> dict[str, Any]:
    rec: dict[str, Any] = {"B": batch, "ctx": ctx}
    lens_u = [ctx] * batch
    lens_s = skewed_lengths(batch, ctx, run.rng) if batch > 1 else None
    nb = max(blocks_of(lens_u), blocks_of(lens_s) if lens_s else 0) + 1
    nb = -(-nb // 8) * 8  # FlexAttention's paged KV length (nb * 16) a multiple of 128
    kv_bytes = batch * ctx * KV_BYTES_PER_TOKEN
    rec["kv_gib"] = kv_bytes / GIB
    n_rot = rotation_count(kv_bytes)
    graph = n_rot > 1
    rec["rotation_buffers"] = n_rot
    caches = [rand_cache(nb) for _ in range(n_rot)]
    perm = torch.randperm(nb, generator=run.gen)
    q = randn(batch, HQ, HEAD)
    variants = {"uniform": lens_u}
    if lens_s is not None:
        variants["skewed"] = lens_s
    metas: dict[str, Meta] = {}
    outs: dict[str, torch.Tensor | None] = {}
    for vname, lens in variants.items():
        meta = make_meta(lens, [1] * batch, perm, run.dev)
        metas[vname] = meta
        out = torch.empty_like(q)
        r, outs[vname] = measure([ours_fn(q, c, out, meta) for c in caches], graph)
        nbytes = decode_bytes(lens)
        add_bw(run, r, nbytes, None)
        rec[vname] = {
            "lens": lens_stats(lens),
            "bytes_read": nbytes,
            "split": plan_dict(meta.plan),
            "ours": r,
        }
    if run.left_for("decode") > 5:
        decode_dense_peers(run, rec, q, caches, metas["uniform"], outs["uniform"], graph, with_flex)
        cleanup()
    if with_flex:
        decode_flex_paged(run, rec, q, caches, metas, outs, graph)
        cleanup()
    del caches, metas, outs
    cleanup()
    return rec


def decode_dense_peers(
    run: Run,
    rec: dict[str, Any],
    q: torch.Tensor,
    caches: list[torch.Tensor],
    meta: Meta,
    ours_out: torch.Tensor | None,
    graph: bool,
    with_flex: bool,
) -> None:
    """SDPA (flash, cuDNN; GQA and packed) and dense FlexAttention on contiguous copies of the
    same K/V (uniform lengths). A function, so that the copies are freed when it returns."""
    uni = rec["uniform"]
    batch, ctx = meta.B, meta.lens[0]
    ours_ms, nbytes = uni["ours"].get("ms"), uni["bytes_read"]
    try:
        if len(caches) == 1 and not free_bytes() > batch * ctx * KV_BYTES_PER_TOKEN + 2 * GIB:
            raise MemoryError(f"no room for a dense copy of {rec['kv_gib']:.1f} GiB")
        dense = [dense_kv(c, meta.bt, ctx) for c in caches]
        for name, make in dense_peer_calls(run, uni, q, meta, with_flex):
            r, o = measure([make(k, v) for k, v in dense], graph)
            add_bw(run, r, nbytes, ours_ms)
            if o is not None and ours_out is not None and "error" not in r:
                r["vs_ours"] = rel_err(ours_out, o)
            uni[name] = r
    except Exception as e:
        uni.setdefault("peer_error", err_str(e))


def dense_peer_calls(
    run: Run, uni: dict[str, Any], q: torch.Tensor, meta: Meta, with_flex: bool
) -> list[tuple[str, Callable[..., Callable[[], torch.Tensor]]]]:
    """The dense peers by name, each making its call from (k, v): SDPA flash and cuDNN, GQA and
    packed, then dense FlexAttention if it is on and fits the budget (else `uni` records why)."""
    q4 = q.view(meta.B, HQ, 1, HEAD)
    qp = q.view(meta.B, HKV, QPK, HEAD)  # the query heads of a KV head as query rows
    peers: list[tuple[str, Callable[..., Callable[[], torch.Tensor]]]] = []
    for backend, label in (("FLASH_ATTENTION", "sdpa_flash"), ("CUDNN_ATTENTION", "sdpa_cudnn")):
        peers.append(
            (f"{label}_gqa", functools.partial(sdpa_fn, backend, q4, causal=False, gqa=True))
        )
        peers.append(
            (f"{label}_packed", functools.partial(sdpa_fn, backend, qp, causal=False, gqa=False))
        )
    if with_flex and run.params["flex_dense_decode"]:
        why = flex_allowed(run, "decode", "flex dense decode")
        if why:
            uni["flex_dense"] = {"error": why}
        else:
            mask = flex_dense_decode_mask(meta.seq_lens, meta.lens[0])
            peers.append(("flex_dense", functools.partial(flex_fn, q4, block_mask=mask)))
    return peers


def decode_flex_paged(
    run: Run,
    rec: dict[str, Any],
    q: torch.Tensor,
    caches: list[torch.Tensor],
    metas: dict[str, Meta],
    outs: dict[str, torch.Tensor | None],
    graph: bool,
) -> None:
    """FlexAttention over the same pages in its paged layout (gather-free paged attention)."""
    try:
        why = flex_allowed(run, "decode", "flex paged decode")
        if why:
            raise RuntimeError(why)
        kv_bytes = sum(metas["uniform"].lens) * KV_BYTES_PER_TOKEN
        if len(caches) == 1 and not free_bytes() > kv_bytes + 3 * GIB:
            raise MemoryError(f"no room for a paged copy of {rec['kv_gib']:.1f} GiB")
        paged = [flex_paged_kv(c) for c in caches]
        for vname, meta in metas.items():
            mask, how = flex_paged_decode_mask(meta, caches[0].shape[0])
            q4 = q.view(meta.B, HQ, 1, HEAD)
            r, o = measure([flex_fn(q4, k, v, mask) for k, v in paged], graph)
            r["implementation"] = how
            add_bw(run, r, rec[vname]["bytes_read"], rec[vname]["ours"].get("ms"))
            if o is not None and outs[vname] is not None and "error" not in r:
                r["vs_ours"] = rel_err(outs[vname], o)
            rec[vname]["flex_paged"] = r
    except Exception as e:
        for vname in metas:
            rec[vname].setdefault("flex_paged", {"error": err_str(e)})


def bench_decode(run: Run) -> None:
    p = run.params
    res: dict[str, Any] = {"shapes": [], "skipped": [], "checks": []}
    run.results["decode"] = res
    res["checks"].append(
        ref_check(run, "decode ragged, split plan", [1000, 37, 2500, 16, 4101], [1] * 5)
    )
    res["checks"].append(
        ref_check(
            run, "decode ragged, no split", [1000, 37, 2500, 16, 4101], [1] * 5, use_plan=False
        )
    )
    run.save()
    flex_shapes = {tuple(s) for s in p["flex_decode_shapes"]}
    for batch, ctx in p["decode_shapes"]:
        kv = batch * ctx * KV_BYTES_PER_TOKEN
        if kv > MAX_KV_BYTES:
            res["skipped"].append({"B": batch, "ctx": ctx, "why": "KV over 40 GiB"})
            continue
        if run.left_for("decode") < 5:
            res["skipped"].append({"B": batch, "ctx": ctx, "why": "time budget"})
            run.log(f"decode B={batch} ctx={ctx}: skipped (time budget)")
            continue
        try:
            rec = decode_shape(run, batch, ctx, (batch, ctx) in flex_shapes)
        except Exception as e:
            rec = {"B": batch, "ctx": ctx, "error": err_str(e)}
            cleanup()
        res["shapes"].append(rec)
        run.save()
        run.log(decode_line(rec))


def decode_line(rec: dict[str, Any]) -> str:
    head = f"decode B={rec['B']:>3} ctx={rec['ctx']:>5}"
    if "error" in rec:
        return f"{head}: ERROR {rec['error']}"
    u = rec["uniform"]
    o = u["ours"]
    if "ms" not in o:
        return f"{head}: ours ERROR {o.get('error')}"
    parts = [
        f"{head} ({rec['kv_gib']:.2f} GiB): ours {o['ms'] * 1e3:8.1f} us "
        f"{o['tb_s']:.2f} TB/s ({o.get('pct_of_copy', float('nan')):.0f}% copy)"
    ]
    if "skewed" in rec and "tb_s" in rec["skewed"]["ours"]:
        parts.append(f"skewed {rec['skewed']['ours']['tb_s']:.2f}")
    for label in ("sdpa_flash", "sdpa_cudnn"):
        parts.append(f"{label} {fmt_peer(best_peer(u, label))}")
    if "flex_dense" in u:
        parts.append(f"flex {fmt_peer(u['flex_dense'])}")
    if "flex_paged" in u:
        fp = u["flex_paged"]
        parts.append(f"flex_paged {fmt_peer(fp)}")
        if "ours_speedup" in fp:
            parts.append(f"ours/flex_paged {fp['ours_speedup']:.2f}x")
    return " | ".join(parts)
