"""Comparing the two engines' outputs per generated-token index: `compare_outputs` (max abs
logit difference, token mismatches, near ties), `step_failure`, and `DEFAULT_ATOL` per dtype."""

from __future__ import annotations

from typing import Any

import torch

from unified_attn.engine.outputs import RequestOutput

DEFAULT_ATOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def compare_outputs(
    legacy: list[RequestOutput], native: list[RequestOutput], atol: float
) -> list[dict[str, Any]]:
    """One row per generated-token index. A request is compared up to its first token mismatch
    (later contexts differ); a mismatch at a near tie (logits within atol, top-2 gap <= 2 atol)
    is counted as a tie, not a failure."""
    rows: dict[int, dict[str, Any]] = {}
    for old, new in zip(legacy, native, strict=True):
        for j in range(max(len(old.output_token_ids), len(new.output_token_ids))):
            row = rows.setdefault(
                j,
                {
                    "token_index": j,
                    "requests": 0,
                    "max_abs_logit_diff": 0.0,
                    "token_mismatches": 0,
                    "ties": 0,
                },
            )
            row["requests"] += 1
            diff = logit_diff(old, new, j)
            row["max_abs_logit_diff"] = max(row["max_abs_logit_diff"], diff)
            if token_at(old, j) != token_at(new, j):
                tie = diff <= atol and top2_gap(new, j) <= 2 * atol
                row["ties" if tie else "token_mismatches"] += 1
                break
    for row in rows.values():
        row["ok"] = row["max_abs_logit_diff"] <= atol and row["token_mismatches"] == 0
    return [rows[j] for j in sorted(rows)]


def step_failure(row: dict[str, Any], atol: float) -> str:
    parts = []
    if row["max_abs_logit_diff"] > atol:
        parts.append(f"max |logit diff| {row['max_abs_logit_diff']:.3g} > atol {atol:g}")
    if row["token_mismatches"]:
        parts.append(f"{row['token_mismatches']} of {row['requests']} sampled tokens differ")
    return f"token index {row['token_index']}: " + ", ".join(parts)


def token_at(out: RequestOutput, j: int) -> int | None:
    return out.output_token_ids[j] if j < len(out.output_token_ids) else None


def logit_diff(old: RequestOutput, new: RequestOutput, j: int) -> float:
    if old.logits is None or new.logits is None or j >= min(len(old.logits), len(new.logits)):
        return float("inf")
    return (old.logits[j] - new.logits[j]).abs().max().item()


def top2_gap(out: RequestOutput, j: int) -> float:
    if out.logits is None or j >= len(out.logits):
        return float("inf")
    top = out.logits[j].topk(2).values
    return (top[0] - top[1]).item()
