"""Conformance suite: any backend class through the unified contract, cell by cell, against the
reference backend driven through the same contract.

Every cell binds a strided cache view (block stride twice the page, non-zero offset) filled
with garbage that differs between the backend and the oracle, so reading a slot nobody wrote
shows up as a difference. Block tables are random and non-contiguous, the KV-cache group id is
not 0, and blocks a window or chunk no longer needs are replaced by the null block as the
managers do. A cell runs two steps: a prefill of the already-computed tokens, then the cell's
batch. Besides the outputs it checks the contract: `get_cache_config` is pure, the output is
written in place and returned, bad shapes and dtypes raise ValueError, and on CUDA `forward`
neither syncs with the host nor allocates (on CPU these two are "not measurable").
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import attrs
import torch

from unified_attn.backend import AttentionBackend, CommonAttentionMetadata, LayerConfig
from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.legacy_adapter import (
    LegacyAttentionBackend,
    LegacyBackendAdapter,
    resolve_any_backend,
)
from unified_attn.selector import SelectorConfig, backend_reasons

GROUP_ID = 3  # not 0: backends must key everything by the group they are given
LAYER = "layers.0.self_attn"
TOL = {torch.float32: 2e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
NOT_MEASURABLE = "not measurable on CPU"


@attrs.frozen
class Cell:
    name: str
    computed: tuple[int, ...]
    new: tuple[int, ...]
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 16
    block_size: int = 16
    sliding_window: int | None = None
    chunk_size: int | None = None
    soft_cap: float | None = None
    sinks: bool = False
    dtype: torch.dtype = torch.float32

    def layer(self) -> LayerConfig:
        return LayerConfig(
            LAYER,
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
            scale=self.head_size**-0.5,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.soft_cap,
            chunk_size=self.chunk_size,
        )

    def backend_kwargs(self) -> dict[str, Any]:
        return {
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "dtype": self.dtype,
            "sliding_window": self.sliding_window,
            "attention_chunk_size": self.chunk_size,
        }

    def selector_config(self, device: str) -> SelectorConfig:
        return SelectorConfig(
            head_size=self.head_size,
            dtype=self.dtype,
            block_size=self.block_size,
            has_sinks=self.sinks,
            sliding_window=self.sliding_window,
            attention_chunk_size=self.chunk_size,
            device=device,
            use_batch_invariant=False,
        )


def mixed(name: str, **options: Any) -> Cell:
    """A prefill, two decodes and a chunked prefill in one batch."""
    return Cell(name, computed=(0, 17, 40, 5), new=(13, 1, 1, 20), **options)


GRID = (
    Cell("prefill", computed=(0, 0), new=(7, 12)),
    Cell("decode", computed=(5, 17, 33), new=(1, 1, 1)),
    mixed("mixed"),
    Cell("chunked prefill", computed=(16, 9, 3), new=(8, 5, 2)),
    mixed("sliding window 8", sliding_window=8),
    mixed("chunked local 16", chunk_size=16),
    mixed("learned sinks", sinks=True),
    mixed("soft cap 2", soft_cap=2.0),
    mixed("GQA 1:1 (MHA)", num_heads=4, num_kv_heads=4),
    mixed("GQA 8:1, head 32", num_heads=8, num_kv_heads=1, head_size=32),
    mixed("block size 8", block_size=8),
)
CUDA_CELLS = tuple(
    attrs.evolve(cell, name=f"{cell.name}, {str(dtype)[6:]}", dtype=dtype)
    for dtype in (torch.float16, torch.bfloat16)
    for cell in GRID
    if cell.name in ("mixed", "decode", "sliding window 8", "learned sinks")
)


@attrs.frozen
class Step:
    """One step's inputs, shared by the backend and the oracle."""

    common: CommonAttentionMetadata
    block_table: torch.Tensor  # [B, max_blocks] int32
    query: torch.Tensor  # [T, Hq * D]
    key: torch.Tensor  # [T, Hkv * D]
    value: torch.Tensor
    requests: tuple[int, ...]  # the cell's request index of every row


def prepare_cli(device: str, threads: int) -> None:
    """Command-line runs: `module:Class` resolves from the working directory too; on CPU the
    Triton kernels run in the interpreter (TRITON_INTERPRET is read when the kernels are first
    imported, so before any backend is resolved) with `threads` intra-op threads (tiny shapes
    run fastest on one; more threads mostly add contention)."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if torch.device(device).type != "cpu":
        return
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(threads)


# ---- batches -----------------------------------------------------------------------------------


def random_table(cell: Cell, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Random, non-contiguous block ids (never the null block 0), one spare column of nulls."""
    counts = [-(-(c + n) // cell.block_size) for c, n in zip(cell.computed, cell.new, strict=True)]
    num_blocks = sum(counts) + 8
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(counts), max(counts) + 1, dtype=torch.int32)
    for i, count in enumerate(counts):
        table[i, :count] = torch.tensor(ids[:count], dtype=torch.int32)
        ids = ids[count:]
    return table, num_blocks


def null_unneeded_blocks(cell: Cell, table: torch.Tensor) -> torch.Tensor:
    """Blocks before the first key any new query may see -> the null block (as managers do)."""
    table = table.clone()
    for i, computed in enumerate(cell.computed):
        first_needed = 0
        if cell.sliding_window is not None:
            first_needed = max(0, computed - cell.sliding_window + 1)
        if cell.chunk_size is not None:
            first_needed = computed // cell.chunk_size * cell.chunk_size
        table[i, : first_needed // cell.block_size] = 0
    return table


def make_step(
    cell: Cell,
    table: torch.Tensor,
    start: list[int],
    end: list[int],
    kv: list[torch.Tensor],
    gen: torch.Generator,
    device: str,
) -> Step:
    """Requests with tokens `[start[i], end[i])` new; `kv[i] [2, S_i, Hkv, D]` their K/V."""
    bs, rows = cell.block_size, [i for i in range(len(start)) if end[i] > start[i]]
    positions = torch.cat([torch.arange(start[i], end[i]) for i in rows])
    owners = torch.cat([torch.full((end[i] - start[i],), i) for i in rows])
    slots = table[owners, positions // bs].long() * bs + positions % bs
    lens = torch.tensor([end[i] - start[i] for i in rows])
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).int()])
    seq_lens = torch.tensor([end[i] for i in rows], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens.to(device),
        seq_lens_cpu=seq_lens,
        num_computed_tokens_cpu=torch.tensor([start[i] for i in rows], dtype=torch.int32),
        positions=positions.to(device),
        num_reqs=len(rows),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=int(lens.max()),
        max_seq_len=int(seq_lens.max()),
        slot_mappings={GROUP_ID: slots.to(device)},
    )
    k = torch.cat([kv[i][0, start[i] : end[i]] for i in rows]).flatten(1)
    v = torch.cat([kv[i][1, start[i] : end[i]] for i in rows]).flatten(1)
    query = torch.randn(len(positions), cell.num_heads * cell.head_size, generator=gen)
    q, k, v = (t.to(device, cell.dtype) for t in (query, k, v))
    return Step(common, table[rows].to(device), q, k, v, tuple(rows))


def make_steps(cell: Cell, device: str, seed: int) -> tuple[list[Step], int]:
    """The history step (the computed tokens) and the cell's step; the block count."""
    gen = torch.Generator().manual_seed(seed)
    table, num_blocks = random_table(cell, gen)
    kv = [
        torch.randn(2, c + n, cell.num_kv_heads, cell.head_size, generator=gen)
        for c, n in zip(cell.computed, cell.new, strict=True)
    ]
    total = [c + n for c, n in zip(cell.computed, cell.new, strict=True)]
    steps = [
        make_step(
            cell, null_unneeded_blocks(cell, table), list(cell.computed), total, kv, gen, device
        )
    ]
    if any(cell.computed):
        history = make_step(cell, table, [0] * len(total), list(cell.computed), kv, gen, device)
        steps.insert(0, history)
    return steps, num_blocks


# ---- running one backend -----------------------------------------------------------------------


def bind(backend: AttentionBackend, cell: Cell, num_blocks: int, seed: int, device: str) -> None:
    """A strided view (block stride twice the page, offset one page) over seeded garbage."""
    _, _, spec = backend.get_cache_config()
    page = spec.page_size_bytes(cell.block_size)
    buffer = torch.empty(2 * page * (num_blocks + 1), dtype=torch.uint8, device=device)
    garbage = buffer.view(cell.dtype)
    garbage.copy_(torch.randn(garbage.shape, generator=torch.Generator().manual_seed(seed)))
    view = spec.make_view(buffer, page, 2 * page, num_blocks, cell.block_size)
    if not isinstance(view, torch.Tensor):
        raise ValueError(f"{backend.name}: the suite checks paged K/V backends, got {spec}")
    backend.bind_kv_caches({LAYER: view}, {LAYER: GROUP_ID})


def run_step(
    backend: AttentionBackend,
    cell: Cell,
    step: Step,
    sinks: torch.Tensor | None,
    checks: dict[str, str] | None = None,
) -> torch.Tensor:
    backend.prep_forward(step.common, {GROUP_ID: step.block_table})
    output = torch.full_like(step.query, float("nan"))
    kwargs = {} if sinks is None else {"sinks": sinks}
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
    result = forward()
    same = result is output or (
        isinstance(result, torch.Tensor) and result.data_ptr() == output.data_ptr()
    )
    checks["in-place output"] = "pass" if same else "fail: forward did not return `output`"
    return output


def measure_cuda(forward: Callable[[], Any], strict_alloc: bool) -> dict[str, str]:
    """Host syncs (sync debug mode "error") and bytes allocated by one `forward` call."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.set_sync_debug_mode("error")
    try:
        forward()
        sync = "pass"
    except RuntimeError as error:
        sync = f"fail: {str(error).splitlines()[0]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    grown, peak = torch.cuda.memory_allocated() - before, torch.cuda.max_memory_allocated() - before
    alloc = "pass" if not grown and not peak else f"{peak} B of temporaries"
    # Kept bytes always fail; temporaries only for backends that claim CUDA graphs.
    if grown or (peak and strict_alloc):
        alloc = f"fail: {grown} B kept, {peak} B peak" + (" (claims CUDA graphs)" * strict_alloc)
    return {"host sync": sync, "allocation": alloc}


def check_cache_config(backend_cls: type[AttentionBackend], cell: Cell) -> str:
    a, b = backend_cls(**cell.backend_kwargs()), backend_cls(**cell.backend_kwargs())
    if a.get_cache_config() != a.get_cache_config():
        return "fail: two calls gave different triples"
    if a.get_cache_config() != b.get_cache_config():
        return "fail: equal instances gave different triples"
    return "pass"


def check_bad_inputs(backend: AttentionBackend, cell: Cell, step: Step) -> str:
    layer = cell.layer()
    bad = {
        "key with a missing column": (step.query, step.key[:, :-1], step.value),
        "query in the wrong dtype": (step.query.to(torch.float64), step.key, step.value),
    }
    for what, (q, k, v) in bad.items():
        try:
            backend.forward(layer, torch.empty_like(step.query), q, k, v)
        except ValueError:
            continue
        except Exception as error:  # any other type breaks the contract
            return f"fail: {what} raised {type(error).__name__}, not ValueError"
        return f"fail: {what} was accepted"
    return "pass"


def run_cell(backend_cls: type[AttentionBackend], cell: Cell, device: str, seed: int = 0) -> dict:
    """One cell: `status` pass / fail / unsupported, `max_err`, the contract `checks`."""
    row: dict[str, Any] = {"cell": cell.name, "tol": TOL[cell.dtype], "max_err": None}
    reasons = backend_reasons(backend_cls, cell.selector_config(device))
    if reasons:
        return row | {"status": "unsupported", "detail": "; ".join(reasons), "checks": {}}
    checks = {"cache config pure": check_cache_config(backend_cls, cell)}
    failed = []
    try:
        row["max_err"], location = compare_with_oracle(backend_cls, cell, device, seed, checks)
        if row["max_err"] > row["tol"]:
            failed.append(f"max error {row['max_err']:.3g} > {row['tol']:g} {location}")
    except Exception as error:  # a crash fails the cell, not the run
        failed.append(f"raised {type(error).__name__}: {error}")
    failed += [f"{k}: {v}" for k, v in checks.items() if v.startswith("fail")]
    status = "fail" if failed else "pass"
    return row | {"status": status, "detail": "; ".join(failed), "checks": checks}


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
        err = (got.float() - expected.float()).abs().nan_to_num(float("inf"))  # [T, Hq * D]
        if err.max().item() > worst[0]:
            worst = (err.max().item(), where(err, step, cell, i, len(steps)))
    checks["rejects bad inputs"] = check_bad_inputs(backend, cell, steps[-1])
    return worst


def where(err: torch.Tensor, step: Step, cell: Cell, index: int, num_steps: int) -> str:
    """Where the largest error is: step, request, token position and query head."""
    token, column = divmod(int(err.argmax()), err.shape[1])
    starts = step.common.query_start_loc_cpu.tolist()
    request = step.requests[max(i for i, start in enumerate(starts[:-1]) if start <= token)]
    position = int(step.common.positions[token])
    return (
        f"(step {index + 1}/{num_steps}, request {request}, position {position}, "
        f"head {column // cell.head_size})"
    )


def run_conformance(
    backend: str | type[AttentionBackend] | type[LegacyAttentionBackend],
    device: str = "cpu",
    cells: tuple[Cell, ...] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Every cell of the grid (plus half-precision cells on CUDA); `report["ok"]`."""
    if isinstance(backend, str):
        backend_cls = resolve_any_backend(backend)
    elif issubclass(backend, LegacyAttentionBackend):
        backend_cls = LegacyBackendAdapter.wrap(backend)
    else:
        backend_cls = backend
    if cells is None:
        cells = GRID + (CUDA_CELLS if torch.device(device).type == "cuda" else ())
    rows = [run_cell(backend_cls, cell, device, seed) for cell in cells]
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


# ---- the `unified-attn check` command ----------------------------------------------------------


def add_parser(commands: Any) -> None:
    check = commands.add_parser("check", help="run a backend through the conformance suite")
    check.add_argument("backend", help="backend NAME or module:Class (legacy classes are wrapped)")
    check.add_argument("--device", default="cpu")
    check.add_argument("--seed", type=int, default=0)
    check.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    check.add_argument("--json", action="store_true", help="print the report as JSON only")
    check.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    prepare_cli(args.device, args.threads)
    report = run_conformance(args.backend, args.device, seed=args.seed)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0 if report["ok"] else 1


CHECKS = ("cache config pure", "in-place output", "rejects bad inputs", "host sync", "allocation")


def check_mark(result: str | None) -> str:
    if result is None:
        return " "
    if result == "pass":
        return "[green]✓[/]"
    if result.startswith("fail"):
        return "[red]✗[/]"
    return "-" if result == NOT_MEASURABLE else "[yellow]~[/]"


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"Conformance of {report['backend']} ({report['class']}) on {report['device']}",
        title_justify="left",
        caption="checks: " + " / ".join(CHECKS) + " (✓ pass, ✗ fail, - not "
        "measurable on CPU, ~ see detail)",
        caption_justify="left",
    )
    for column in ("cell", "status", "max err", "checks", "detail"):
        table.add_column(column, overflow="fold")
    colour = {"pass": "green", "fail": "red", "unsupported": "yellow"}
    for r in report["cells"]:
        marks = " ".join(check_mark(r["checks"].get(name)) for name in CHECKS)
        notes = [f"{k}: {v}" for k, v in r["checks"].items() if v.endswith("temporaries")]
        detail = "; ".join(filter(None, [r.get("detail", ""), *notes]))
        max_err = "" if r["max_err"] is None else f"{r['max_err']:.1e}"
        table.add_row(r["cell"], f"[{colour[r['status']]}]{r['status']}", max_err, marks, detail)
    console = Console()
    console.print(table)
    verdict = "[green]PASS" if report["ok"] else "[red]FAIL"
    console.print(
        f"{verdict}[/]: {report['passed']} passed, {report['failed']} failed, "
        f"{report['unsupported']} unsupported"
    )
