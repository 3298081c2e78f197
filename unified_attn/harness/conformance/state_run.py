"""Running a state cell (`run_state_cell`): the backend bound to state views over garbage,
driven step by step through `prep_forward` and `forward`, each step's outputs and the states
it must leave (`StateWrite`) compared with the oracle (`state_oracle.py`), and the contract
checks (a pure `get_cache_config` naming `StateManager` in the cell's mode, in-place output,
ValueError on bad inputs, on CUDA no host sync and no allocation in the last step)."""

from __future__ import annotations

import functools
from typing import Any

import attrs
import torch

from unified_attn.backend import (
    AttentionBackend,
    CommonAttentionMetadata,
    require_cache_config,
)
from unified_attn.harness.conformance.cells import LAYER
from unified_attn.harness.conformance.checks import (
    NOT_MEASURABLE,
    cell_result,
    check_in_place,
    measure_cuda,
    refuses_each,
)
from unified_attn.harness.conformance.state_cells import StateCell
from unified_attn.harness.conformance.state_kinds import ForwardArgs, State
from unified_attn.harness.conformance.state_oracle import StateOracle
from unified_attn.harness.conformance.state_steps import PlannedStep
from unified_attn.harness.conformance.steps import GROUP_ID, batch_metadata
from unified_attn.managers import StateManager
from unified_attn.selector import backend_reasons
from unified_attn.tensor_specs import StateSpec

Worst = tuple[float, str]  # the largest error and where it is


def run_state_cell(
    backend_cls: type[AttentionBackend], cell: StateCell, device: str, seed: int = 0
) -> dict[str, Any]:
    """One state cell: `status` pass / fail / unsupported, `max_err`, the contract `checks`."""
    row: dict[str, Any] = {"cell": cell.name, "type": cell.kind, "tol": cell.state.tol,
                           "max_err": None}  # fmt: skip
    reasons = backend_reasons(backend_cls, cell.selector_config(device))

    def checked(checks: dict[str, str]) -> Worst:
        if torch.device(device).type == "cuda":
            # A state update cannot run twice, so the warm-up (library workspaces, kernel
            # compilation) is a whole throwaway run of the cell before the measured one.
            compare_state(backend_cls, cell, device, seed, {})
        return compare_state(backend_cls, cell, device, seed, checks)

    return cell_result(row, reasons, checked)


def compare_state(
    backend_cls: type[AttentionBackend], cell: StateCell, device: str, seed: int, checks: dict
) -> Worst:
    """Every step of the cell on the backend and the oracle: the largest error and where."""
    gen = torch.Generator().manual_seed(seed)
    steps, num_logical = cell.plan()
    backend = backend_cls(**cell.backend_kwargs())
    checks["cache config pure"] = check_state_cache_config(backend_cls, cell)
    views, physical = _bind(backend, cell, num_logical, device, gen)
    weights = cell.state.weights(cell, gen)
    oracle = StateOracle(cell, weights, gen)
    worst: Worst = (-1.0, "")
    for index, step in enumerate(steps):
        rows = oracle.inputs(step)
        tables = _tables(step, physical).to(device)
        backend.prep_forward(_metadata(cell, step, device), {GROUP_ID: tables})
        args = cell.state.forward_args(_to(rows, device), _to(weights, device))
        output = torch.full((len(args[0]), cell.num_heads * cell.head_size), float("nan"),
                            device=device)  # fmt: skip
        last = index == len(steps) - 1
        _forward_with_checks(backend, cell, args, output, checks if last else None)
        expected, after = oracle.run(step, rows)
        where = f"step {index + 1}/{len(steps)}"
        errors = [_output_error(output, expected, step, where),
                  *_state_errors(cell, step, views, physical, after, where)]  # fmt: skip
        worst = max([worst, *errors], key=lambda e: e[0])
    checks["rejects bad inputs"] = _check_bad_inputs(backend, cell, args)
    return worst


def check_state_cache_config(backend_cls: type[AttentionBackend], cell: StateCell) -> str:
    a, b = backend_cls(**cell.backend_kwargs()), backend_cls(**cell.backend_kwargs())
    manager, config, spec = require_cache_config(a)
    if manager is not StateManager or not isinstance(spec, StateSpec):
        return f"fail: expected StateManager and a StateSpec, got {manager.__name__}, {spec}"
    if a.get_cache_config() != b.get_cache_config():
        return "fail: equal instances gave different triples"
    expected = StateManager.Config(cell.mode, cell.num_speculative_blocks)
    if config != expected:
        return f"fail: expected {expected} (the mode and draft slots asked for), got {config}"
    return "pass"


def _bind(
    backend: AttentionBackend, cell: StateCell, num_logical: int, device: str,
    gen: torch.Generator,
) -> tuple[tuple[torch.Tensor, ...], list[int]]:  # fmt: skip
    """State views over garbage (block stride twice the page, offset one page); the random
    physical block id of each logical one (the null block stays 0)."""
    _, _, spec = require_cache_config(backend)
    num_blocks = num_logical + 4
    page = spec.page_size_bytes(cell.block_size)
    buffer = torch.empty(2 * page * (num_blocks + 1), dtype=torch.uint8)
    buffer.view(torch.float32).copy_(torch.randn(buffer.numel() // 4, generator=gen))
    views = spec.make_view(buffer.to(device), page, 2 * page, num_blocks, cell.block_size)
    backend.bind_kv_caches({LAYER: views}, {LAYER: GROUP_ID})
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    return tuple(views), [0, *ids[:num_logical]]


def _tables(step: PlannedStep, physical: list[int]) -> torch.Tensor:
    """`[R, width + 1]` int32: the step's tables in physical ids, a spare column of nulls."""
    width = max(len(t) for t in step.tables) + 1
    table = torch.zeros(len(step.tables), width, dtype=torch.int32)
    for i, row in enumerate(step.tables):
        table[i, : len(row)] = torch.tensor([physical[b] for b in row], dtype=torch.int32)
    return table


def _metadata(cell: StateCell, step: PlannedStep, device: str) -> CommonAttentionMetadata:
    """No slots (state layers write their blocks, not token slots); the speculation fields
    when a request verifies drafts or resumes from a draft's column."""
    end = [d + n for d, n in zip(step.done, step.new, strict=True)]
    rows = list(step.rows)
    slots = {GROUP_ID: torch.full((sum(step.new),), -1, device=device)}
    common = batch_metadata(list(step.done), end, rows, slots, device,
                            {GROUP_ID: cell.block_size})  # fmt: skip
    if step.drafts is None or step.columns is None:
        return common
    return attrs.evolve(
        common,
        num_drafts_cpu=torch.tensor(step.drafts, dtype=torch.int32),
        state_columns_cpu=torch.tensor(step.columns, dtype=torch.int32),
    )


def _to(value: Any, device: str) -> Any:
    """Rows (a dict of tensors) or weights (None, or a NamedTuple of tensors and Nones) on
    `device`."""
    if isinstance(value, dict):
        return {k: v.to(device) for k, v in value.items()}
    if value is None:
        return None
    return value._make(t if t is None else t.to(device) for t in value)


def _forward_with_checks(
    backend: AttentionBackend, cell: StateCell, args: ForwardArgs, output: torch.Tensor,
    checks: dict | None,
) -> None:  # fmt: skip
    """One `forward` call (a state update must happen exactly once), with the contract checks
    recorded into `checks` when given."""
    q, k, v, kwargs = args
    forward = functools.partial(backend.forward, cell.layer(), output, q, k, v, **kwargs)
    if checks is None:
        forward()
        return
    results: list[Any] = []
    if output.is_cuda:
        strict = type(backend).supports_cuda_graphs()
        checks.update(measure_cuda(lambda: results.append(forward()), strict))
    else:
        checks.update({"host sync": NOT_MEASURABLE, "allocation": NOT_MEASURABLE})
        results.append(forward())
    checks["in-place output"] = check_in_place(results[0], output)


def _check_bad_inputs(backend: AttentionBackend, cell: StateCell, args: ForwardArgs) -> str:
    """Inputs of the wrong shape or dtype must raise ValueError."""
    q, k, v, kwargs = args
    layer, out = cell.layer(), torch.empty(len(q), cell.num_heads * cell.head_size,
                                           device=q.device)  # fmt: skip
    return refuses_each({
        "query with a missing column": lambda: backend.forward(
            layer, out, q[:, :-1], k, v, **kwargs),
        "key with a missing column": lambda: backend.forward(
            layer, out, q, k[:, :-1], v, **kwargs),
        "query in the wrong dtype": lambda: backend.forward(
            layer, out, q.double(), k, v, **kwargs),
    })  # fmt: skip


def _output_error(
    output: torch.Tensor, expected: torch.Tensor, step: PlannedStep, where: str
) -> Worst:
    """The largest error of the step's outputs (NaN counts as infinite) and its request and
    position."""
    err = (output.cpu().double() - expected.double()).abs().nan_to_num(float("inf"))
    token = int(err.max(dim=1).values.argmax())
    for r in step.rows:
        if token < step.new[r]:
            position = step.done[r] + token
            return err.max().item(), f"({where}, request {r}, output at position {position})"
        token -= step.new[r]
    raise AssertionError("the token is past the step's rows")


def _state_errors(
    cell: StateCell, step: PlannedStep, views: tuple[torch.Tensor, ...], physical: list[int],
    after: dict[int, list[State]], where: str,
) -> list[Worst]:  # fmt: skip
    """The largest error of each state the step must leave, over its parts (NaN counts as
    infinite), and which state and part."""
    errors = []
    for write in step.writes:
        held = [view[physical[write.block]].cpu().double() for view in views]
        expected = after[write.request][write.rows - 1]
        tokens = step.done[write.request] + write.rows
        rejected = " (a rejected draft's)" if write.rows > step.kept[write.request] else ""
        errors += [
            ((got - want.double()).abs().nan_to_num(float("inf")).max().item(),
             f"({where}, request {write.request}, {part} after {tokens} tokens{rejected})")
            for got, want, part in zip(held, expected, cell.state.parts, strict=True)
        ]  # fmt: skip
    return errors
