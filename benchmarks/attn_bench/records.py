"""Reading the result records: the faster SDPA variant and compact number formats, shared by the
progress lines, the verdicts, the report and the plot."""

from __future__ import annotations

from typing import Any


def best_peer(v: dict[str, Any], label: str) -> dict[str, Any] | None:
    """The faster of the `gqa` and `packed` variants of an SDPA backend."""
    recs = [v.get(f"{label}_{x}") for x in ("gqa", "packed")]
    recs = [r for r in recs if r and "ms" in r]
    return min(recs, key=lambda r: r["ms"]) if recs else None


def fmt_peer(r: dict[str, Any] | None, key: str = "tb_s") -> str:
    if r is None:
        return "-"
    if key in r:
        return f"{r[key]:.2f}"
    return "err" if "error" in r else "-"


def kfmt(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)
