"""`run_migration`: both engines on the workload, compared step by step, with coverage, lines
of code and timings, as a JSON-able report; `find_failures` lists what makes it fail."""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection
from typing import Any

import attrs

from unified_attn.backend import AttentionBackend
from unified_attn.engine.llm_engine import LLMEngine
from unified_attn.harness.migration.code_size import lines_of_code, source_lines
from unified_attn.harness.migration.compare import DEFAULT_ATOL, compare_outputs, step_failure
from unified_attn.harness.migration.engine_run import REQUIRED_COVERAGE, coverage, run_workload
from unified_attn.harness.migration.migration_workload import (
    Workload,
    engine_kwargs,
    pressured_budget,
)
from unified_attn.harness.migration.timing import host_time
from unified_attn.legacy_adapter import LegacyBackendAdapter
from unified_attn.runner.model_source import model_config
from unified_attn.selector import backend_classes, resolve_backend


def run_migration(
    legacy: str,
    native: str,
    *,
    model: str = "tiny-hybrid",
    device: str = "cpu",
    dtype: str = "float32",
    atol: float | None = None,
    workload: Workload | None = None,
    seed: int = 0,
    measure_host_time: bool = True,
) -> dict[str, Any]:
    """Run both engines on the workload and return the JSON-able report (`report["ok"]`)."""
    workload = workload or Workload()
    check_atol(atol)
    classes = {"legacy": resolve_legacy(legacy), "native": resolve_native(native)}
    prompts = workload.prompts(model_config(model).vocab_size)
    kwargs = engine_kwargs(workload, prompts, device, dtype, seed)
    probe = LLMEngine(model, backend=classes["native"], **kwargs)
    peak = run_workload(probe, prompts, workload.max_tokens).peak_blocks
    kwargs["kv_cache_memory"], note = pressured_budget(probe, peak)
    runs = {
        side: run_workload(LLMEngine(model, backend=cls, **kwargs), prompts, workload.max_tokens)
        for side, cls in classes.items()
    }
    tol = atol if atol is not None else DEFAULT_ATOL[probe.model.dtype]
    steps = compare_outputs(runs["legacy"].outputs, runs["native"].outputs, tol)
    covered = {side: coverage(run, workload, prompts) for side, run in runs.items()}
    cannot = workload_limits(workload, prompts) | ({"preemptions": note} if note else {})
    # a limit is said only where it mattered: what no run exercised
    notes = [why for key, why in cannot.items() if not all(c[key] for c in covered.values())]
    failures = find_failures(steps, covered, tol, excused=set(cannot))
    report = {
        "ok": not failures,
        "failures": failures,
        "notes": notes,
        "legacy": {"arg": legacy, "backend": classes["legacy"].name},
        "native": {"arg": native, "backend": classes["native"].name},
        "model": model,
        "device": device,
        "dtype": dtype,
        "atol": tol,
        "seed": seed,
        "workload": attrs.asdict(workload),
        "coverage": covered,
        "steps": steps,
        "max_abs_logit_diff": max((r["max_abs_logit_diff"] for r in steps), default=0.0),
        "token_mismatches": sum(r["token_mismatches"] for r in steps),
        "ties": sum(r["ties"] for r in steps),
        "lines_of_code": {side: lines_of_code(cls) for side, cls in classes.items()}
        | {"adapter (shared)": source_lines(LegacyBackendAdapter)},
        # Median: the engine run first also pays one-time costs (kernel compilation, CUDA init).
        "engine_step_ms": {side: statistics.median(run.step_ms) for side, run in runs.items()},
    }
    if measure_host_time:
        report["host_time"] = host_time(classes, model, probe)
    return report


def workload_limits(workload: Workload, prompts: list[list[int]]) -> dict[str, str]:
    """What the workload cannot exercise however it is run, each with the note that says so."""
    limits = {}
    if len(prompts) < 2:
        limits["mixed_prefill_decode_steps"] = "one request cannot mix prefill and decode steps"
    if len(prompts) <= workload.num_prefixes:
        limits["prefix_hit_tokens"] = "no two requests share a prefix: no prefix hit is possible"
    if max(len(p) for p in prompts) <= workload.max_num_batched_tokens:
        limits["chunked_prefills"] = "every prompt fits one step: no prefill is chunked"
    return limits


def find_failures(
    steps: list[dict[str, Any]],
    covered: dict[str, dict[str, int]],
    atol: float,
    excused: Collection[str] = (),
) -> list[str]:
    """The failing token indices, then every required coverage key a side did not exercise
    (except those the workload cannot exercise, `excused`)."""
    required = [k for k in REQUIRED_COVERAGE if k not in excused]
    failures = [step_failure(r, atol) for r in steps if not r["ok"]]
    failures += [
        f"the workload did not exercise {key} ({side})"
        for side, cov in covered.items()
        for key in required
        if not cov[key]
    ]
    return failures


def check_atol(atol: float | None) -> None:
    if atol is not None and not (math.isfinite(atol) and atol >= 0):
        raise ValueError(f"atol must be a finite number >= 0 (or None: the dtype's), got {atol}")


def legacy_names() -> list[str]:
    classes = backend_classes().items()
    return sorted(n for n, cls in classes if issubclass(cls, LegacyBackendAdapter))


def resolve_legacy(name: str) -> type[AttentionBackend]:
    """`--legacy`: a four-class backend behind the adapter (`legacy-x`, `x` for short, or
    `module:Class` of a legacy backend); a native backend or an unknown name is refused."""
    hint = f"use one of {', '.join(legacy_names())} or module:Class of a four-class backend"
    if ":" not in name and legacy_name(name) not in backend_classes():
        raise ValueError(f"--legacy {name!r} is not a legacy backend; {hint}")
    cls = resolve_backend(legacy_name(name))
    if not issubclass(cls, LegacyBackendAdapter):
        raise ValueError(f"--legacy {name!r} is a native backend ({cls.name}); {hint}")
    return cls


def resolve_native(name: str) -> type[AttentionBackend]:
    """`--native`: a backend written to the contract; the adapter over a legacy backend is
    refused (migrate would compare the legacy code with itself)."""
    cls = resolve_backend(name)
    if issubclass(cls, LegacyBackendAdapter):
        raise ValueError(
            f"--native {name!r} is the adapter over a legacy backend ({cls.name}), not a native "
            "one; pass a native backend (see `unified-attn backends`)"
        )
    return cls


def legacy_name(name: str) -> str:
    """`--legacy x` means the legacy port `legacy-x` when there is one."""
    return f"legacy-{name}" if f"legacy-{name}" in backend_classes() else name
