"""Driving one backend through the unified contract for a cell: `bind` a strided KV-cache view
over garbage, `run_step` (prep_forward, with no block tables for an encoder pass, then forward
into a NaN-filled output), recording the in-place, host-sync and allocation checks when asked
to."""

from __future__ import annotations

import functools

import torch

from unified_attn.backend import AttentionBackend, require_cache_config
from unified_attn.harness.conformance.cells import LAYER, AttentionCell
from unified_attn.harness.conformance.checks import NOT_MEASURABLE, check_in_place, measure_cuda
from unified_attn.harness.conformance.steps import GROUP_ID, Step


def bind(
    backend: AttentionBackend, cell: AttentionCell, num_blocks: int, seed: int, device: str
) -> torch.Tensor:
    """A strided view (block stride twice the page, offset one page) over seeded garbage;
    returns the view (`[num_blocks, 2, block_size, Hkv, D]`) the backend was bound to."""
    _, _, spec = require_cache_config(backend)
    page = spec.page_size_bytes(cell.block_size)
    buffer = torch.empty(2 * page * (num_blocks + 1), dtype=torch.uint8, device=device)
    garbage = buffer.view(cell.dtype)
    garbage.copy_(torch.randn(garbage.shape, generator=torch.Generator().manual_seed(seed)))
    view = spec.make_view(buffer, page, 2 * page, num_blocks, cell.block_size)
    if not isinstance(view, torch.Tensor):
        raise ValueError(f"{backend.name}: the suite checks paged K/V backends, got {spec}")
    backend.bind_kv_caches({LAYER: view}, {LAYER: GROUP_ID})
    return view


def run_step(
    backend: AttentionBackend,
    cell: AttentionCell,
    step: Step,
    sinks: torch.Tensor | None,
    checks: dict[str, str] | None = None,
    extra: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One step through the contract; `extra`: more forward kwargs (fp8 `kv_scales`)."""
    tables = {} if step.block_table is None else {GROUP_ID: step.block_table}
    backend.prep_forward(step.common, tables)
    output = torch.full_like(step.query, float("nan"))
    kwargs = ({} if sinks is None else {"sinks": sinks}) | (extra or {})
    forward = functools.partial(
        backend.forward, cell.layer(), output, step.query, step.key, step.value, **kwargs
    )
    if checks is None:  # the oracle
        forward()
        return output
    if output.is_cuda:
        forward()  # warm-up: the measured call below is the same step
        checks.update(measure_cuda(forward, type(backend).supports_cuda_graphs()))
    else:
        checks.update({"host sync": NOT_MEASURABLE, "allocation": NOT_MEASURABLE})
    checks["in-place output"] = check_in_place(forward(), output)
    return output
