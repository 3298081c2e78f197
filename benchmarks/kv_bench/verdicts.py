"""The targets against this run's results: the hybrid decode step time (comparable only at 256
running requests) and the flatness of the BlockPool µs/block over N for each variant."""

from __future__ import annotations

from typing import Any

from .config import DECODE_TARGET_REQUESTS, DECODE_TARGET_US, FLAT_MAX_RATIO, HYBRID, POOL_METRICS


def verdicts(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    hybrid = results["decode"].get(HYBRID)
    if hybrid is not None:
        med = hybrid["step_us"]["median"]
        out["hybrid_decode_step"] = {
            "target_us": DECODE_TARGET_US,
            "target_num_requests": DECODE_TARGET_REQUESTS,
            "num_requests": hybrid["num_requests"],
            "measured_median_us": med,
            "measured_p90_us": hybrid["step_us"]["p90"],
            "meets_target": hybrid["num_requests"] >= DECODE_TARGET_REQUESTS
            and med <= DECODE_TARGET_US,
            "comparable": hybrid["num_requests"] == DECODE_TARGET_REQUESTS,
        }
    flat = {}
    for variant, key in POOL_METRICS.items():
        vals = [r[variant][key] for r in results["block_pool"].values()]
        ratio = max(vals) / min(vals) if min(vals) > 0 else float("inf")
        flat[variant] = {"metric": key, "max_over_min": ratio, "flat": ratio <= FLAT_MAX_RATIO}
    out["block_pool_flat"] = {"threshold_max_over_min": FLAT_MAX_RATIO, **flat}
    return out
