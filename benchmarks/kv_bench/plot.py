"""The PNG: µs per block against the BlockPool size N for each variant, and the decode step time
(median and p90) per configuration against the hybrid target. Skipped, with a note, without
matplotlib."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import pyplot, save_figure
from rich.console import Console

from .config import DECODE_TARGET_US, POOL_METRICS

SERIES_LABELS = {
    "unhashed": "get+free, unhashed",
    "hashed_evicting": "get+free, evicting",
    "touch_middle": "touch (mid-queue)",
}


def plot(results: dict[str, Any], path: Path, console: Console) -> bool:
    plt = pyplot(console)
    if plt is None:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ns = sorted(results["block_pool"], key=int)
    xs = [int(n) for n in ns]
    for variant, key in POOL_METRICS.items():
        label = SERIES_LABELS[variant]
        ax1.plot(xs, [results["block_pool"][n][variant][key] for n in ns], marker="o", label=label)
    ax1.set_xscale("log")
    ax1.set_ylim(bottom=0)
    ax1.set_xlabel("BlockPool size N (blocks)")
    ax1.set_ylabel("µs per block")
    ax1.set_title("BlockPool operations: µs/block vs N")
    ax1.legend()
    ax1.grid(True, alpha=0.3)

    names = list(results["decode"])
    med = [results["decode"][n]["step_us"]["median"] for n in names]
    p90 = [results["decode"][n]["step_us"]["p90"] for n in names]
    pos = range(len(names))
    ax2.bar([x - 0.2 for x in pos], med, width=0.4, label="median")
    ax2.bar([x + 0.2 for x in pos], p90, width=0.4, label="p90")
    ax2.axhline(DECODE_TARGET_US, color="red", linestyle="--", label="target (hybrid)")
    ax2.set_xticks(list(pos))
    ax2.set_xticklabels(names)
    nreq = results["params"]["decode_requests"]
    ax2.set_ylabel(f"µs per decode step ({nreq} requests)")
    ax2.set_title("Decode step time per config")
    ax2.legend()
    ax2.grid(True, axis="y", alpha=0.3)
    fig.suptitle(
        f"unified_attn KV-cache manager — {results['machine']['cpu_model']}, "
        f"Python {results['machine']['python_version']} ({results['mode']})"
    )
    save_figure(fig, path, dpi=120)
    return True
