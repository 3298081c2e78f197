"""Running the suite: `run_cell` (one attention cell of any type: pass / fail / unsupported,
within `TOL` of its oracle, with the contract checks), the batch-invariance cells
(`invariance.py`) and `run_conformance` (every cell, as a JSON-able report)."""

from __future__ import annotations

from typing import Any

import torch

from unified_attn.backend import AttentionBackend, AttentionType
from unified_attn.harness.conformance.cells import (
    CROSS_GRID,
    CUDA_CELLS,
    ENCODER_GRID,
    FP8_GRID,
    GRID,
    AttentionCell,
    CrossCell,
)
from unified_attn.harness.conformance.checks import cell_result, check_cache_config
from unified_attn.harness.conformance.fp8 import compare_fp8
from unified_attn.harness.conformance.invariance import (
    CUDA_INVARIANCE_CELLS,
    INVARIANCE_GRID,
    InvarianceCell,
    run_invariance_cell,
)
from unified_attn.harness.conformance.manager_cells import manager_cells
from unified_attn.harness.conformance.mla_cells import (
    CUDA_MLA_CELLS,
    MLA_GRID,
    MLACell,
    run_mla_cell,
)
from unified_attn.harness.conformance.oracle import compare_with_oracle
from unified_attn.harness.conformance.sdpa import compare_cross, compare_encoder
from unified_attn.harness.conformance.state_cells import StateCell, state_grid, state_kinds_of
from unified_attn.harness.conformance.state_run import run_state_cell
from unified_attn.legacy_adapter import LegacyAttentionBackend
from unified_attn.selector import backend_reasons, resolve_backend

TOL = {torch.float32: 2e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def run_cell(
    backend_cls: type[AttentionBackend], cell: AttentionCell, device: str, seed: int = 0
) -> dict:
    """One cell: `status` pass / fail / unsupported (with the backend's reasons for the cell's
    `SelectorConfig`, attention type included), `max_err`, the contract `checks`."""
    row: dict[str, Any] = {
        "cell": cell.name,
        "type": cell.attn_type.value,
        "tol": TOL[cell.dtype],
        "max_err": None,
    }
    reasons = backend_reasons(backend_cls, cell.selector_config(device))

    def checked(checks: dict[str, str]) -> tuple[float, str]:
        checks["cache config pure"] = check_cache_config(backend_cls, cell)
        return compare(backend_cls, cell, device, seed, checks)

    return cell_result(row, reasons, checked)


def compare(
    backend_cls: type[AttentionBackend], cell: AttentionCell, device: str, seed: int, checks: dict
) -> tuple[float, str]:
    """The cell against its oracle: the reference backend for decoder cells, the backend's own
    dequantized cache for fp8 cells, SDPA otherwise."""
    if isinstance(cell, CrossCell):
        return compare_cross(backend_cls, cell, device, seed, checks)
    if cell.kv_cache_dtype != "auto":
        return compare_fp8(backend_cls, cell, device, seed, checks)
    if cell.attn_type == AttentionType.DECODER:
        return compare_with_oracle(backend_cls, cell, device, seed, checks)
    return compare_encoder(backend_cls, cell, device, seed, checks)


def backend_class(
    backend: str | type[AttentionBackend] | type[LegacyAttentionBackend],
) -> type[AttentionBackend]:
    """A name or `module:Class` resolved, a legacy class wrapped, a native class as it is."""
    return resolve_backend(backend)


AnyCell = AttentionCell | StateCell | InvarianceCell | MLACell


def default_cells(backend_cls: type[AttentionBackend], device: str) -> tuple[AnyCell, ...]:
    """The grid of every layer kind the backend computes: attention cells of all four types,
    over an fp8 cache and batch invariance (those the backend does not declare come out
    unsupported), the state cells of each state kind, MLA cells; half-precision cells on
    CUDA."""
    cells: tuple[AnyCell, ...] = ()
    if "attention" in backend_cls.layer_kinds:
        cells += GRID + ENCODER_GRID + CROSS_GRID + FP8_GRID + INVARIANCE_GRID
        if torch.device(device).type == "cuda":
            cells += CUDA_CELLS + CUDA_INVARIANCE_CELLS
    for kind in state_kinds_of(backend_cls):
        cells += state_grid(kind)
    if "mla" in backend_cls.layer_kinds:
        cells += MLA_GRID
        cells += CUDA_MLA_CELLS if torch.device(device).type == "cuda" else ()
    return cells or GRID  # a kind the suite does not know: the attention cells say so


def run_any_cell(
    backend_cls: type[AttentionBackend], cell: AnyCell, device: str, seed: int
) -> dict[str, Any]:
    if isinstance(cell, StateCell):
        return run_state_cell(backend_cls, cell, device, seed)
    if isinstance(cell, InvarianceCell):
        return run_invariance_cell(backend_cls, cell, device, seed)
    if isinstance(cell, MLACell):
        return run_mla_cell(backend_cls, cell, device, seed)
    return run_cell(backend_cls, cell, device, seed)


def run_conformance(
    backend: str | type[AttentionBackend] | type[LegacyAttentionBackend],
    device: str = "cpu",
    cells: tuple[AnyCell, ...] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Every cell of the backend's layer kinds (`default_cells`) and, for attention backends,
    the managers its `get_cache_config` returns (`manager_cells`); or only `cells`.
    `report["ok"]`."""
    backend_cls = backend_class(backend)
    managers = cells is None and "attention" in backend_cls.layer_kinds
    if cells is None:
        cells = default_cells(backend_cls, device)
    rows = [run_any_cell(backend_cls, cell, device, seed) for cell in cells]
    rows += manager_cells(backend_cls, device) if managers else []
    return {
        "backend": backend_cls.name,
        "class": f"{backend_cls.__module__}.{backend_cls.__qualname__}",
        "device": device,
        # Nothing run is no evidence: a backend that supports no cell does not pass.
        "ok": all(r["status"] != "fail" for r in rows) and any(r["status"] == "pass" for r in rows),
        "passed": sum(r["status"] == "pass" for r in rows),
        "failed": sum(r["status"] == "fail" for r in rows),
        "unsupported": sum(r["status"] == "unsupported" for r in rows),
        "cells": rows,
    }
