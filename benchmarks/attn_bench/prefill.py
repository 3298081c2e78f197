"""The prefill section: causal prefill of equal-length prompts, ours against SDPA flash / cuDNN
and compiled FlexAttention, in TFLOP/s of visible keys."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from common import HEAD, HQ, PAGE

from .config import QPK
from .data import dense_kv, rand_cache, randn
from .meta import make_meta, ours_fn
from .peers import flex_allowed, flex_fn, flex_prefill_mask, sdpa_fn
from .records import fmt_peer
from .reference import ref_check
from .run import Run, err_str
from .timing import cleanup, measure, rel_err


def causal_visible(q_len: int, seq_len: int, window: int | None = None) -> int:
    """Sum over the queries of their visible keys (queries at the last `q_len` positions)."""
    total = 0
    for i in range(seq_len - q_len, seq_len):
        total += min(i + 1, window) if window else i + 1
    return total


def attn_flops(visible: int) -> int:
    return 4 * visible * HQ * HEAD


def add_flops(rec: dict[str, Any], flops: int, ours_ms: float | None) -> None:
    if "ms" not in rec:
        return
    rec["tflop_s"] = flops / rec["ms"] / 1e9
    if ours_ms:
        rec["ours_speedup"] = rec["ms"] / ours_ms


class PrefillCase:
    """One batch of equal-length prompts, all tokens new, KV already in the paged cache."""

    def __init__(self, run: Run, batch: int, length: int):
        self.batch, self.length = batch, length
        nb = batch * -(-length // PAGE) + 1
        self.cache = rand_cache(nb)
        self.meta = make_meta(
            [length] * batch, [length] * batch, torch.randperm(nb, generator=run.gen), run.dev
        )
        self.q = randn(batch * length, HQ, HEAD)
        self.out = torch.empty_like(self.q)

    def ours(self, **kwargs: Any) -> Callable[[], torch.Tensor]:
        return ours_fn(self.q, self.cache, self.out, self.meta, **kwargs)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qd = self.q.view(self.batch, self.length, HQ, HEAD).transpose(1, 2).contiguous()
        k, v = dense_kv(self.cache, self.meta.bt, self.length)
        return qd, k, v

    def to_tokens(self, out: torch.Tensor) -> torch.Tensor:
        """[B, HQ, L, D] -> [B * L, HQ, D]."""
        return out.transpose(1, 2).reshape(self.batch * self.length, HQ, HEAD)


def prefill_shape(run: Run, batch: int, length: int, with_flex: bool) -> dict[str, Any]:
    rec: dict[str, Any] = {"B": batch, "L": length}
    case = PrefillCase(run, batch, length)
    flops = attn_flops(batch * causal_visible(length, length))
    rec["flops"] = flops
    r, ours_out = measure([case.ours()], graph=False)
    add_flops(r, flops, None)
    rec["ours"] = r
    qd, k, v = case.dense()
    for backend, label in (("FLASH_ATTENTION", "sdpa_flash"), ("CUDNN_ATTENTION", "sdpa_cudnn")):
        rec[label] = versus_ours(case, sdpa_prefill(backend, qd, k, v), flops, r, ours_out)
    if with_flex:
        why = flex_allowed(run, "prefill", "flex prefill")
        if why:
            rec["flex"] = {"error": why}
        else:
            rec["flex"] = versus_ours(case, flex_prefill(qd, k, v, length), flops, r, ours_out)
    del case, qd, k, v, ours_out
    cleanup()
    return rec


def sdpa_prefill(
    backend: str, qd: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[dict[str, Any], torch.Tensor | None]:
    """Causal SDPA with `enable_gqa`, or on K/V expanded to all query heads if it is refused."""
    r, o = measure([sdpa_fn(backend, qd, k, v, causal=True, gqa=True)], graph=False)
    r["variant"] = "enable_gqa"
    if "error" in r and "finite" not in r:
        first_error = r["error"]
        ke, ve = k.repeat_interleave(QPK, dim=1), v.repeat_interleave(QPK, dim=1)
        r, o = measure([sdpa_fn(backend, qd, ke, ve, causal=True, gqa=False)], graph=False)
        r.update(variant="kv_expanded", gqa_error=first_error)
    return r, o


def flex_prefill(
    qd: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int
) -> tuple[dict[str, Any], torch.Tensor | None]:
    """Compiled FlexAttention with the causal block mask."""
    try:
        return measure([flex_fn(qd, k, v, flex_prefill_mask(length, qd.device))], graph=False)
    except Exception as e:
        return {"error": err_str(e)}, None


def versus_ours(
    case: PrefillCase,
    measured: tuple[dict[str, Any], torch.Tensor | None],
    flops: int,
    ours: dict[str, Any],
    ours_out: torch.Tensor | None,
) -> dict[str, Any]:
    """A peer's record with its TFLOP/s, our speedup over it and its difference from our output."""
    r, o = measured
    add_flops(r, flops, ours.get("ms"))
    if o is not None and ours_out is not None and "error" not in r:
        r["vs_ours"] = rel_err(ours_out, case.to_tokens(o))
    return r


def prefill_line(rec: dict[str, Any]) -> str:
    head = f"prefill B={rec['B']} L={rec['L']:>5}"
    if "error" in rec:
        return f"{head}: ERROR {rec['error']}"
    parts = [f"{head}: ours {fmt_peer(rec['ours'], 'tflop_s')} TFLOP/s"]
    for label in ("sdpa_flash", "sdpa_cudnn", "flex"):
        if label in rec:
            r = rec[label]
            extra = f" (ours {r['ours_speedup']:.2f}x)" if "ours_speedup" in r else ""
            parts.append(f"{label} {fmt_peer(r, 'tflop_s')}{extra}")
    return " | ".join(parts)


def bench_prefill(run: Run) -> None:
    p = run.params
    res: dict[str, Any] = {"shapes": [], "skipped": [], "checks": []}
    run.results["prefill"] = res
    res["checks"].append(ref_check(run, "prefill ragged causal", [700, 1300], [700, 1300]))
    res["checks"].append(ref_check(run, "chunked prefill (context 900)", [1200], [300]))
    run.save()
    flex_shapes = {tuple(s) for s in p["flex_prefill_shapes"]}
    for batch, length in p["prefill_shapes"]:
        if run.left_for("prefill") < 5:
            res["skipped"].append({"B": batch, "L": length, "why": "time budget"})
            run.log(f"prefill B={batch} L={length}: skipped (time budget)")
            continue
        try:
            rec = prefill_shape(run, batch, length, (batch, length) in flex_shapes)
        except Exception as e:
            rec = {"B": batch, "L": length, "error": err_str(e)}
            cleanup()
        res["shapes"].append(rec)
        run.save()
        run.log(prefill_line(rec))
