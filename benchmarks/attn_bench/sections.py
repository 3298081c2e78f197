"""The smaller sections: the machine's ceilings (copy bandwidth, bf16 matmul), the sliding
window against full causal, the sinks / soft-cap overheads, and split-KV against no split."""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from typing import Any

import torch
from common import HEAD, HQ, PAGE, gpu_ms

from .config import ELT, GIB, KV_BYTES_PER_TOKEN, SOFT_CAP, WINDOW
from .data import rand_cache, randn
from .decode import add_bw, decode_bytes
from .meta import make_meta, ours_fn, plan_dict
from .peers import flex_allowed, flex_fn, flex_prefill_mask
from .prefill import PrefillCase, add_flops, attn_flops, causal_visible, versus_ours
from .reference import ref_check
from .run import Run, err_str
from .timing import cleanup, measure, rel_err, rotation_count


def bench_ceilings(run: Run) -> dict[str, Any]:
    res: dict[str, Any] = {}
    n = 2 * GIB // ELT
    src = randn(n)
    dst = torch.empty_like(src)
    ms = gpu_ms(functools.partial(dst.copy_, src))
    moved = 2 * n * ELT
    res["copy"] = {"bytes_read_plus_written": moved, "ms": ms, "tb_s": moved / ms / 1e9}
    del src, dst
    m = 8192
    a, b = randn(m, m), randn(m, m)
    c = torch.empty_like(a)
    ms = gpu_ms(functools.partial(torch.matmul, a, b, out=c))
    res["matmul_bf16_8192"] = {"flops": 2 * m**3, "ms": ms, "tflop_s": 2 * m**3 / ms / 1e9}
    del a, b, c
    cleanup()
    run.copy_tb_s = res["copy"]["tb_s"]
    run.log(
        f"ceilings: copy {res['copy']['tb_s']:.2f} TB/s, "
        f"bf16 matmul {res['matmul_bf16_8192']['tflop_s']:.0f} TFLOP/s"
    )
    return res


def bench_window(run: Run) -> None:
    length = run.params["window_len"]
    res: dict[str, Any] = {"L": length, "W": WINDOW, "B": 1, "checks": []}
    run.results["window"] = res
    res["checks"].append(ref_check(run, f"prefill window {WINDOW}", [3000], [3000], window=WINDOW))
    res["checks"].append(
        ref_check(run, f"decode window {WINDOW}", [3000, 900], [1, 1], window=WINDOW)
    )
    run.save()
    case = PrefillCase(run, 1, length)
    full_flops = attn_flops(causal_visible(length, length))
    win_flops = attn_flops(causal_visible(length, length, WINDOW))
    r_full, o_full = measure([case.ours()], graph=False)
    add_flops(r_full, full_flops, None)
    r_win, o_win = measure([case.ours(window=WINDOW)], graph=False)
    add_flops(r_win, win_flops, None)
    res["ours_full"], res["ours_window"] = r_full, r_win
    res["ideal_speedup_tiles"] = length / (2 * WINDOW)
    res["ideal_speedup_exact_keys"] = full_flops / win_flops
    if "ms" in r_full and "ms" in r_win:
        res["speedup"] = r_full["ms"] / r_win["ms"]
        res["pct_of_ideal"] = 100.0 * res["speedup"] / res["ideal_speedup_tiles"]
    res["sdpa"] = {
        "error": "not run: SDPA has no window option; a dense 32k x 32k mask is not a fair peer"
    }
    del o_full
    if run.params["flex_window"]:
        window_flex(run, res, case, (full_flops, win_flops), o_win)
    else:
        res["flex_window"] = {"error": "not run (flex_window off in this mode)"}
    del case, o_win
    cleanup()
    run.save()
    if "speedup" in res:
        run.log(
            f"window W={WINDOW} L={length}: full {r_full['ms']:.2f} ms, "
            f"window {r_win['ms']:.3f} ms, "
            f"speedup {res['speedup']:.2f}x of ideal {res['ideal_speedup_tiles']:.1f}x "
            f"({res['pct_of_ideal']:.0f}%)"
        )
    else:
        run.log(f"window: ERROR {r_full.get('error') or r_win.get('error')}")


def window_flex(
    run: Run,
    res: dict[str, Any],
    case: PrefillCase,
    flops: tuple[int, int],
    ours_window_out: torch.Tensor | None,
) -> None:
    """Compiled FlexAttention, causal and with the window's mask, on dense copies of the K/V:
    `flops` are the full and the windowed counts."""
    why = flex_allowed(run, "window", "flex window")
    if why:
        res["flex_window"] = {"error": why}
        return
    try:
        qd, k, v = case.dense()
        rf, _ = measure([flex_fn(qd, k, v, flex_prefill_mask(case.length, qd.device))], graph=False)
        add_flops(rf, flops[0], res["ours_full"].get("ms"))
        windowed = measure(
            [flex_fn(qd, k, v, flex_prefill_mask(case.length, qd.device, WINDOW))], graph=False
        )
        rw = versus_ours(case, windowed, flops[1], res["ours_window"], ours_window_out)
        res["flex_full"], res["flex_window"] = rf, rw
        if "ms" in rf and "ms" in rw:
            res["flex_speedup"] = rf["ms"] / rw["ms"]
            res["flex_pct_of_ideal"] = 100.0 * res["flex_speedup"] / res["ideal_speedup_tiles"]
    except Exception as e:
        res["flex_window"] = {"error": err_str(e)}


def bench_features(run: Run) -> None:
    res: dict[str, Any] = {"checks": []}
    run.results["features"] = res
    sinks = torch.randn(HQ, generator=run.gen).float().to(run.dev)
    lens = [1000, 37, 2500, 4101]
    res["checks"] += [
        ref_check(run, "decode sinks (split)", lens, [1] * 4, sinks=sinks),
        ref_check(run, "decode sinks (no split)", lens, [1] * 4, sinks=sinks, use_plan=False),
        ref_check(run, "decode soft cap (split)", lens, [1] * 4, soft_cap=SOFT_CAP),
        ref_check(run, "prefill sinks", [700, 1300], [700, 1300], sinks=sinks),
        ref_check(run, "prefill soft cap", [700, 1300], [700, 1300], soft_cap=SOFT_CAP),
    ]
    run.save()
    batch, ctx = run.params["features_decode"]
    nb = batch * ctx // PAGE + 1
    cache = rand_cache(nb)
    meta = make_meta([ctx] * batch, [1] * batch, torch.randperm(nb, generator=run.gen), run.dev)
    q = randn(batch, HQ, HEAD)
    out = torch.empty_like(q)
    decode = functools.partial(ours_fn, q, cache, out, meta)
    res["decode"] = {
        "B": batch,
        "ctx": ctx,
        "split": plan_dict(meta.plan),
        **overheads(run, f"decode B={batch} ctx={ctx}", decode, sinks),
    }
    del cache, q, out, meta, decode
    cleanup()
    run.save()
    length = run.params["features_prefill_len"]
    case = PrefillCase(run, 1, length)
    res["prefill"] = {
        "B": 1,
        "L": length,
        **overheads(run, f"prefill L={length}", case.ours, sinks),
    }
    del case
    cleanup()
    run.save()


def overheads(
    run: Run, name: str, make: Callable[..., Callable[[], torch.Tensor]], sinks: torch.Tensor
) -> dict[str, Any]:
    """Times of `make()` plain, with sinks, with the soft cap and plain again (drift shows as a
    plain / plain-again gap), and the features' overheads over the mean plain time."""
    out: dict[str, Any] = {}
    for key, kwargs in (
        ("plain", {}),
        ("sinks", {"sinks": sinks}),
        ("soft_cap", {"soft_cap": SOFT_CAP}),
        ("plain_again", {}),
    ):
        r, _ = measure([make(**kwargs)], graph=False)
        out[key] = r
    base = [out[k]["ms"] for k in ("plain", "plain_again") if "ms" in out[k]]
    if base:
        out["plain_ms_mean"] = statistics.fmean(base)
        for key in ("sinks", "soft_cap"):
            if "ms" in out[key]:
                out[f"{key}_overhead_pct"] = 100.0 * (out[key]["ms"] / out["plain_ms_mean"] - 1)
    run.log(
        f"features {name}: plain {out.get('plain_ms_mean', float('nan')) * 1e3:.1f} us, "
        f"sinks {out.get('sinks_overhead_pct', float('nan')):+.1f}%, "
        f"soft cap {out.get('soft_cap_overhead_pct', float('nan')):+.1f}%"
    )
    return out


def bench_split(run: Run) -> None:
    ctx = run.params["split_ctx"]
    res: dict[str, Any] = {"B": 1, "ctx": ctx, "checks": []}
    run.results["split"] = res
    res["checks"].append(ref_check(run, "decode B=1 5000 split plan", [5000], [1]))
    nb = ctx // PAGE + 1
    kv_bytes = ctx * KV_BYTES_PER_TOKEN
    n_rot = rotation_count(kv_bytes)
    caches = [rand_cache(nb) for _ in range(n_rot)]
    meta = make_meta([ctx], [1], torch.randperm(nb, generator=run.gen), run.dev)
    q = randn(1, HQ, HEAD)
    out = torch.empty_like(q)
    nbytes = decode_bytes([ctx])
    res["plan"] = plan_dict(meta.plan)
    res["rotation_buffers"] = n_rot
    r_split, o_split = measure([ours_fn(q, c, out, meta) for c in caches], graph=n_rot > 1)
    add_bw(run, r_split, nbytes, None)
    r_none, o_none = measure(
        [ours_fn(q, c, out, meta, use_plan=False) for c in caches], graph=n_rot > 1
    )
    add_bw(run, r_none, nbytes, None)
    res["with_plan"], res["split_none"] = r_split, r_none
    if o_split is not None and o_none is not None:
        res["with_plan"]["vs_split_none"] = rel_err(o_split, o_none)
    if "ms" in r_split and "ms" in r_none:
        res["speedup"] = r_none["ms"] / r_split["ms"]
        run.log(
            f"split B=1 ctx={ctx}: plan {res['plan']} {r_split['tb_s']:.2f} TB/s, "
            f"split=None {r_none['tb_s']:.2f} TB/s, speedup {res['speedup']:.2f}x"
        )
    del caches, meta, q, out
    cleanup()
    run.save()
