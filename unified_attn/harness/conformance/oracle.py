"""Comparison with the decoder oracle (the reference backend through the same contract):
`compare_with_oracle` runs a cell's steps on both and returns the largest error and `where` it
is (`largest_error`, shared with the SDPA oracle of `sdpa`)."""

from __future__ import annotations

import torch

from unified_attn.backend import AttentionBackend
from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.harness.conformance.cells import AttentionCell, Cell
from unified_attn.harness.conformance.checks import check_bad_inputs
from unified_attn.harness.conformance.driver import bind, run_step
from unified_attn.harness.conformance.steps import Step, make_steps


def compare_with_oracle(
    backend_cls: type[AttentionBackend], cell: Cell, device: str, seed: int, checks: dict
) -> tuple[float, str]:
    """Run the cell's steps on the backend and the oracle: the largest error and where it is."""
    steps, num_blocks = make_steps(cell, device, seed)
    sinks = torch.randn(cell.num_heads, generator=torch.Generator().manual_seed(seed + 1))
    sinks_dev = sinks.to(device) if cell.sinks else None
    backend = backend_cls(**cell.backend_kwargs())
    oracle = ReferenceAttentionBackend(**cell.backend_kwargs())
    bind(backend, cell, num_blocks, seed + 2, device)
    bind(oracle, cell, num_blocks, seed + 3, device)
    worst = (-1.0, "")
    for i, step in enumerate(steps):
        expected = run_step(oracle, cell, step, sinks_dev)
        got = run_step(backend, cell, step, sinks_dev, checks if i == len(steps) - 1 else {})
        error = largest_error(got, expected, step, cell, i, len(steps))
        worst = max(worst, error, key=lambda e: e[0])
    checks["rejects bad inputs"] = check_bad_inputs(backend, cell, steps[-1])
    return worst


def largest_error(
    got: torch.Tensor,
    expected: torch.Tensor,
    step: Step,
    cell: AttentionCell,
    index: int,
    num_steps: int,
) -> tuple[float, str]:
    """The largest absolute error of a step's output `[T, Hq * D]` (NaN counts as infinite)
    and where it is."""
    err = (got.cpu().double() - expected.cpu().double()).abs().nan_to_num(float("inf"))
    return err.max().item(), where(err, step, cell, index, num_steps)


def where(err: torch.Tensor, step: Step, cell: AttentionCell, index: int, num_steps: int) -> str:
    """Where the largest error is: step, request, token position and query head."""
    token, column = divmod(int(err.argmax()), err.shape[1])
    starts = step.common.query_start_loc_cpu.tolist()
    request = step.requests[max(i for i, start in enumerate(starts[:-1]) if start <= token)]
    position = int(step.common.positions[token])
    return (
        f"(step {index + 1}/{num_steps}, request {request}, position {position}, "
        f"head {column // cell.head_size})"
    )
