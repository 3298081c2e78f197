"""The targets (KERNELS_AND_BENCHMARKS.md) against this run's results: one verdict per target that
the run measured, each with its bar, the measured figures and whether it is met."""

from __future__ import annotations

import statistics
from typing import Any

from .config import SECTIONS, TARGETS, TOLERANCE, WINDOW
from .records import kfmt

Verdicts = list[dict[str, Any]]


def verdicts(results: dict[str, Any]) -> Verdicts:
    shapes = [s for s in results.get("decode", {}).get("shapes", []) if "uniform" in s]
    return [
        *large_decode_verdicts(shapes),
        *small_decode_verdicts(shapes),
        *flex_paged_verdicts(shapes),
        *prefill_verdicts(results.get("prefill", {})),
        *window_verdicts(results.get("window", {})),
        *feature_verdicts(results.get("features", {})),
        *split_verdicts(results.get("split", {})),
        *check_verdicts(results),
    ]


def verdict(name: str, target: str, measured: str, met: bool | None) -> dict[str, Any]:
    return {"name": name, "target": target, "measured": measured, "met": met}


def tb(s: dict[str, Any], variant: str = "uniform") -> float | None:
    """Our TB/s at a decode shape, None if not measured."""
    return s.get(variant, {}).get("ours", {}).get("tb_s")


def large_decode_verdicts(shapes: list[dict[str, Any]]) -> Verdicts:
    large = [s for s in shapes if s["kv_gib"] >= TARGETS["decode_large_min_kv_gib"] and tb(s)]
    if not large:
        return []
    worst = min(large, key=tb)
    vals = [tb(s) for s in large]
    out = [
        verdict(
            "decode, KV >= 4 GiB (uniform)",
            f">= {TARGETS['decode_large_tb_s']} TB/s",
            f"worst {tb(worst):.2f} (B={worst['B']} ctx={worst['ctx']}), "
            f"median {statistics.median(vals):.2f} TB/s over {len(vals)} shapes",
            min(vals) >= TARGETS["decode_large_tb_s"],
        )
    ]
    skew = [tb(s, "skewed") for s in large if tb(s, "skewed")]
    if skew:
        out.append(
            verdict(
                "decode, KV >= 4 GiB (skewed lengths)",
                f">= {TARGETS['decode_large_tb_s']} TB/s",
                f"worst {min(skew):.2f}, median {statistics.median(skew):.2f} TB/s",
                min(skew) >= TARGETS["decode_large_tb_s"],
            )
        )
    return out


def small_decode_verdicts(shapes: list[dict[str, Any]]) -> Verdicts:
    """B 16-32 at 8k, and B=1 at 32k (split-KV)."""
    out = []
    mid = [s for s in shapes if s["B"] in (16, 32) and s["ctx"] == 8192 and tb(s)]
    if mid:
        out.append(
            verdict(
                "decode B 16-32, ctx 8k",
                f">= {TARGETS['decode_mid_tb_s']} TB/s",
                ", ".join(f"B={s['B']}: {tb(s):.2f}" for s in mid),
                min(tb(s) for s in mid) >= TARGETS["decode_mid_tb_s"],
            )
        )
    b1 = [s for s in shapes if s["B"] == 1 and s["ctx"] == 32768 and tb(s)]
    if b1:
        out.append(
            verdict(
                "decode B=1, ctx 32k",
                f">= {TARGETS['decode_b1_32k_tb_s']} TB/s",
                f"{tb(b1[0]):.2f} TB/s",
                tb(b1[0]) >= TARGETS["decode_b1_32k_tb_s"],
            )
        )
    return out


def flex_paged_verdicts(shapes: list[dict[str, Any]]) -> Verdicts:
    flex = [
        (s, s["uniform"]["flex_paged"]["ours_speedup"])
        for s in shapes
        if "ours_speedup" in s["uniform"].get("flex_paged", {})
    ]
    if not flex:
        return []
    big = [x for s, x in flex if s["kv_gib"] >= TARGETS["decode_large_min_kv_gib"]]
    return [
        verdict(
            "decode vs FlexAttention paged (time ratio)",
            f">= {TARGETS['decode_vs_flex_paged']}x (large work)",
            ", ".join(f"B={s['B']} ctx={s['ctx']}: {x:.2f}x" for s, x in flex),
            min(big) >= TARGETS["decode_vs_flex_paged"] if big else None,
        )
    ]


def prefill_verdicts(prefill: dict[str, Any]) -> Verdicts:
    out = []
    pre = [s for s in prefill.get("shapes", []) if "ours" in s]
    for label, key, tgt in (
        ("prefill vs SDPA flash", "sdpa_flash", TARGETS["prefill_vs_sdpa_flash"]),
        ("prefill vs SDPA cuDNN (stretch)", "sdpa_cudnn", TARGETS["prefill_vs_sdpa_cudnn_stretch"]),
    ):
        vals = [(s, s[key]["ours_speedup"]) for s in pre if "ours_speedup" in s.get(key, {})]
        if vals:
            out.append(
                verdict(
                    label,
                    f">= {tgt}x",
                    ", ".join(f"B={s['B']} L={kfmt(s['L'])}: {x:.2f}x" for s, x in vals),
                    min(x for _, x in vals) >= tgt,
                )
            )
    return out


def window_verdicts(win: dict[str, Any]) -> Verdicts:
    if "pct_of_ideal" not in win:
        return []
    return [
        verdict(
            f"sliding window W={WINDOW}, L={kfmt(win['L'])} prefill",
            f">= {TARGETS['window_pct_of_ideal']:.0f}% of L/(2W) = "
            f"{win['ideal_speedup_tiles']:.1f}x",
            f"{win['speedup']:.2f}x = {win['pct_of_ideal']:.0f}%",
            win["pct_of_ideal"] >= TARGETS["window_pct_of_ideal"],
        )
    ]


def feature_verdicts(feats: dict[str, Any]) -> Verdicts:
    out = []
    for where in ("decode", "prefill"):
        shape = feats.get(where, {})
        size = (
            f"B={shape.get('B')} ctx={shape.get('ctx')}"
            if where == "decode"
            else f"L={shape.get('L')}"
        )
        for feat in ("sinks", "soft_cap"):
            key = f"{feat}_overhead_pct"
            if key in shape:
                val = shape[key]
                out.append(
                    verdict(
                        f"{feat} overhead, {where} {size}",
                        f"<= {TARGETS['feature_overhead_pct']:.0f}%",
                        f"{val:+.1f}%",
                        val <= TARGETS["feature_overhead_pct"],
                    )
                )
    return out


def split_verdicts(split: dict[str, Any]) -> Verdicts:
    if "speedup" not in split:
        return []
    return [
        verdict(
            f"split-KV, B=1 ctx {split['ctx']} (plan vs split=None)",
            "plan faster",
            f"{split['with_plan']['tb_s']:.2f} vs {split['split_none']['tb_s']:.2f} TB/s "
            f"({split['speedup']:.2f}x)",
            split["speedup"] > 1.0 if split.get("plan") else None,
        )
    ]


def check_verdicts(results: dict[str, Any]) -> Verdicts:
    """Every section's checks of ours against the fp32 reference, as one verdict."""
    checks = [
        c for sec in SECTIONS for c in results.get(sec, {}).get("checks", []) if isinstance(c, dict)
    ]
    if not checks:
        return []
    bad = [c["name"] for c in checks if not c.get("ok")]
    return [
        verdict(
            "correctness vs fp32 reference (small shapes)",
            f"max |diff| / max |ref| <= {TOLERANCE}",
            f"{len(checks) - len(bad)}/{len(checks)} ok" + (f"; failed: {bad}" if bad else ""),
            not bad,
        )
    ]
