"""Batch-invariance cells: a backend that claims `supports_batch_invariance()` must give a
request's output rows the same bits however the request is batched and chunked.

An `InvarianceCell` is one layer (a `Cell`'s options and dtype) and a target request of
`prompt` tokens then one decode token, whose queries, keys and values are fixed per position.
The backend, built with `batch_invariant=True`, runs `SCHEDULES`, each on a fresh cache with
its own random block table: the target's whole prompt alone then its decode alone (the
baseline); its prompt in chunks of 16 alone; and its prompt in two chunks, then its decode,
each time among companions (prefills, chunked prefills and decodes of random data) at another
place in the batch. Every schedule's target rows must equal the baseline's bitwise. fp8 cells
pass checkpoint scales: calibration on a step's keys would make the scales depend on the batch.
A backend that does not claim the property is `unsupported` with the selector's reasons.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from unified_attn.backend import AttentionBackend
from unified_attn.harness.conformance.cells import Cell
from unified_attn.harness.conformance.checks import crash
from unified_attn.harness.conformance.driver import bind, run_step
from unified_attn.harness.conformance.steps import GROUP_ID, Step, batch_metadata, random_table
from unified_attn.selector import backend_reasons
from unified_attn.utils import cdiv

TARGET = 0
# One schedule: its steps; a step: (request, first new position, end) in batch order. Request 0
# is the target (45 prompt tokens, then one decode token); requests 1-7 are companions.
Schedule = tuple[tuple[tuple[int, int, int], ...], ...]
SCHEDULES: dict[str, Schedule] = {
    "alone": (((0, 0, 45),), ((0, 45, 46),)),
    "chunks of 16, alone": (((0, 0, 16),), ((0, 16, 32),), ((0, 32, 45),), ((0, 45, 46),)),
    "in batches, chunks of 20 and 25": (
        ((1, 0, 30), (2, 0, 17), (0, 0, 20), (3, 0, 5)),
        ((0, 20, 45), (2, 17, 18), (3, 5, 14), (4, 0, 3)),
        ((1, 30, 31), (2, 18, 19), (3, 14, 15), (4, 3, 4), (0, 45, 46)),
    ),
    "decode among 7": (
        ((0, 0, 45), *((r, 0, 4 + 9 * r) for r in range(1, 8))),
        (*((r, 4 + 9 * r, 5 + 9 * r) for r in (5, 1, 7, 2)), (0, 45, 46),
         *((r, 4 + 9 * r, 5 + 9 * r) for r in (3, 6, 4))),
    ),
}  # fmt: skip
# the tokens each request reaches in any schedule
LENGTHS = tuple(
    max(e for steps in SCHEDULES.values() for step in steps for r, _, e in step if r == request)
    for request in range(8)
)


@attrs.frozen
class InvarianceCell:
    """`layer` carries the options and dtype (its `computed` / `new` are unused)."""

    name: str
    layer: Cell

    def selector_config(self, device: str) -> Any:
        return attrs.evolve(self.layer.selector_config(device), use_batch_invariant=True)


def _cell(name: str, **options: Any) -> InvarianceCell:
    return InvarianceCell(f"batch invariance: {name}", Cell(name, (0,), (1,), **options))


INVARIANCE_GRID = (
    _cell("plain"),
    _cell("sliding window 8", sliding_window=8),
    _cell("chunked local 16", chunk_size=16),
    _cell("learned sinks, soft cap 2", sinks=True, soft_cap=2.0),
    _cell("GQA 8:1, head 32", num_heads=8, num_kv_heads=1, head_size=32),
    _cell("fp8 cache", kv_cache_dtype="fp8", kv_scales=(0.02, 0.03)),
)
CUDA_INVARIANCE_CELLS = tuple(
    attrs.evolve(c, name=f"{c.name}, bfloat16", layer=attrs.evolve(c.layer, dtype=torch.bfloat16))
    for c in INVARIANCE_GRID
)


@attrs.frozen
class Request:
    """Fixed per-position data of one request: `q [S, Hq * D]`, `k` and `v [S, Hkv * D]`."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def make_requests(cell: Cell, seed: int) -> list[Request]:
    gen = torch.Generator().manual_seed(seed)
    kv_width = cell.num_kv_heads * cell.head_size
    return [
        Request(
            *(
                torch.randn(n, width, generator=gen)
                for width in (cell.num_heads * cell.head_size, kv_width, kv_width)
            )
        )
        for n in LENGTHS
    ]


def run_schedule(
    backend_cls: type[AttentionBackend],
    cell: Cell,
    schedule: Schedule,
    requests: list[Request],
    device: str,
    seed: int,
) -> torch.Tensor:
    """The target's output rows `[46, Hq * D]` in position order, from a fresh backend bound to
    a fresh cache with a random block table."""
    backend = backend_cls(**cell.backend_kwargs(), batch_invariant=True)
    gen = torch.Generator().manual_seed(seed)
    table, num_blocks = random_table([cdiv(n, cell.block_size) for n in LENGTHS], gen)
    bind(backend, cell, num_blocks, seed, device)
    sinks = torch.randn(cell.num_heads, generator=torch.Generator().manual_seed(7)).to(device)
    extra = (
        {} if cell.kv_scales is None else {"kv_scales": torch.tensor(cell.kv_scales, device=device)}
    )
    rows = torch.full((LENGTHS[TARGET], cell.num_heads * cell.head_size), float("nan"))
    for entries in schedule:
        step = make_schedule_step(cell, table, entries, requests, device)
        out = run_step(backend, cell, step, sinks if cell.sinks else None, None, extra)
        offset = 0
        for request, start, end in entries:
            if request == TARGET:
                rows[start:end] = out[offset : offset + end - start].float().cpu()
            offset += end - start
    return rows


def make_schedule_step(
    cell: Cell,
    table: torch.Tensor,
    entries: tuple[tuple[int, int, int], ...],
    requests: list[Request],
    device: str,
) -> Step:
    order = [r for r, _, _ in entries]
    start, end = [0] * len(LENGTHS), [0] * len(LENGTHS)
    for r, s, e in entries:
        start[r], end[r] = s, e
    bs = cell.block_size
    positions = torch.cat([torch.arange(start[r], end[r]) for r in order])
    owners = torch.cat([torch.full((end[r] - start[r],), r) for r in order])
    slots = table[owners, positions // bs].long() * bs + positions % bs
    common = batch_metadata(start, end, order, {GROUP_ID: slots.to(device)}, device)
    q, k, v = (
        torch.cat([getattr(requests[r], name)[start[r] : end[r]] for r in order]).to(
            device, cell.dtype
        )
        for name in ("q", "k", "v")
    )
    return Step(common, table[order].to(device), q, k, v, tuple(order))


def run_invariance_cell(
    backend_cls: type[AttentionBackend], cell: InvarianceCell, device: str, seed: int = 0
) -> dict[str, Any]:
    """`status` pass (every schedule bitwise the baseline) / fail / unsupported; `max_err`: the
    largest difference from the baseline."""
    row: dict[str, Any] = {
        "cell": cell.name,
        "type": "batch_invariance",
        "tol": 0.0,
        "max_err": None,
    }
    reasons = backend_reasons(backend_cls, cell.selector_config(device))
    if reasons:
        return row | {"status": "unsupported", "detail": "; ".join(reasons), "checks": {}}
    failed = []
    try:
        requests = make_requests(cell.layer, seed)
        outputs = {
            name: run_schedule(backend_cls, cell.layer, schedule, requests, device, seed + i)
            for i, (name, schedule) in enumerate(SCHEDULES.items())
        }
        baseline = outputs.pop("alone")
        worst = 0.0
        for name, got in outputs.items():
            diff = (got - baseline).abs().nan_to_num(float("inf"))
            worst = max(worst, diff.max().item())
            if not torch.equal(got, baseline):
                positions = diff.amax(-1).nonzero().flatten().tolist()
                failed.append(f"{name}: positions {positions} differ by up to {diff.max():.3g}")
        row["max_err"] = worst
    except Exception as error:  # a crash fails the cell, not the run
        failed.append(crash(error))
    return row | {"status": "fail" if failed else "pass", "detail": "; ".join(failed), "checks": {}}
