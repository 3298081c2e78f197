"""Migration harness: a legacy backend (through `LegacyBackendAdapter`) against a native one.

Two `LLMEngine`s with the same weights (same preset and seed, or the same checkpoint) run the
same workload: shared prefixes (prefix hits), prompts longer than the token budget (chunked
prefill), staggered admission (mixed prefill/decode steps) and a KV cache one request wide
(forced preemption). Per generated-token index the logits (max abs difference) and the sampled
tokens are compared. The report adds lines of code per backend and host time per step.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import random
import statistics
import textwrap
import time
from typing import Any

import attrs
import torch

from unified_attn.backend import AttentionBackend
from unified_attn.legacy_adapter import LegacyBackendAdapter, resolve_any_backend
from unified_attn.runner.engine import LLMEngine, RequestOutput
from unified_attn.sampling_params import SamplingParams
from unified_attn.selector import register_backend, registered_backends, resolve_backend

DEFAULT_ATOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


@attrs.frozen
class Workload:
    num_requests: int = 8
    num_prefixes: int = 2
    prefix_len: int = 40
    tail_len: tuple[int, int] = (4, 24)
    max_tokens: int = 8
    max_num_batched_tokens: int = 32  # < prompt length: every prefill is chunked
    max_model_len: int = 256
    spare_blocks: int = 4  # KV budget: one max_model_len request plus this many blocks
    seed: int = 0

    def prompts(self, vocab_size: int) -> list[list[int]]:
        rng = random.Random(self.seed)
        vocab = min(vocab_size, 256)
        prefixes = [
            [rng.randrange(vocab) for _ in range(self.prefix_len)] for _ in range(self.num_prefixes)
        ]
        return [
            prefixes[i % self.num_prefixes]
            + [rng.randrange(vocab) for _ in range(rng.randint(*self.tail_len))]
            for i in range(self.num_requests)
        ]


# Three requests, still with chunked prefills, a prefix hit, mixed steps and a preemption.
SMALL_WORKLOAD = Workload(
    num_requests=3,
    prefix_len=20,
    tail_len=(8, 11),
    max_tokens=4,
    max_num_batched_tokens=16,
    max_model_len=64,
    spare_blocks=0,
)


@attrs.define
class EngineRun:
    engine: LLMEngine
    outputs: list[RequestOutput]
    step_ms: list[float]
    mixed_steps: int


# ---- resolving and running ---------------------------------------------------------------------


def engine_backend_name(cls: type[AttentionBackend]) -> str:
    """What `LLMEngine(backend=...)` resolves to exactly `cls`: its `module:Class` path, or for a
    class made at run time (a legacy class wrapped by `resolve_any_backend`) its name, which is
    then registered with an empty priority map (by name only, never chosen automatically)."""
    path = f"{cls.__module__}:{cls.__qualname__}"
    try:
        if resolve_backend(path) is cls:
            return path
    except (ImportError, AttributeError, ValueError):
        pass
    taken = registered_backends().get(cls.name)
    same_port = getattr(taken, "legacy_backend", None) is getattr(cls, "legacy_backend", cls)
    if taken is not None and taken is not cls and not same_port:
        raise ValueError(
            f"backend name {cls.name!r} is taken by {taken.__qualname__}; give "
            f"{cls.__qualname__} a distinct name (for a legacy backend: get_name())"
        )
    register_backend(priority={})(cls)
    return cls.name


def kv_budget(engine: LLMEngine, spare_blocks: int) -> int:
    """Bytes for one `max_model_len` request plus `spare_blocks`: concurrency forces preemption."""
    worker = engine.worker
    return worker.plan.bytes_per_block * (sum(worker.blocks_per_request) + 1 + spare_blocks)


def engine_kwargs(workload: Workload, device: str, dtype: str, seed: int) -> dict[str, Any]:
    return {
        "device": device,
        "dtype": dtype,
        "seed": seed,
        "max_model_len": workload.max_model_len,
        "max_num_batched_tokens": workload.max_num_batched_tokens,
        "cuda_graphs": False,  # compare the backends, not the graph runtime
    }


def run_workload(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> EngineRun:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, return_logits=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, RequestOutput] = {}
    step_ms, mixed, stats = [], 0, engine.stats
    while engine.has_unfinished_requests():
        before = (stats.prefill_tokens, stats.decode_tokens)
        start = time.perf_counter()
        finished = engine.step()
        step_ms.append(1e3 * (time.perf_counter() - start))
        mixed += stats.prefill_tokens > before[0] and stats.decode_tokens > before[1]
        done.update((out.request_id, out) for out in finished)
    return EngineRun(engine, [done[i] for i in ids], step_ms, mixed)


def coverage(run: EngineRun, workload: Workload, prompts: list[list[int]]) -> dict[str, int]:
    layers = [layer for layer, _ in run.engine.model.attention_layers()]
    return {
        "mixed_prefill_decode_steps": run.mixed_steps,
        "chunked_prefills": sum(len(p) > workload.max_num_batched_tokens for p in prompts),
        "prefix_hit_tokens": run.engine.kv_cache_manager.prefix_cache_stats.hits,
        "preemptions": run.engine.scheduler.num_preemptions,
        "sliding_window_layers": sum(layer.sliding_window is not None for layer in layers),
        "chunked_local_layers": sum(layer.chunk_size is not None for layer in layers),
    }


REQUIRED_COVERAGE = (
    "mixed_prefill_decode_steps",
    "chunked_prefills",
    "prefix_hit_tokens",
    "preemptions",
)


# ---- comparing ---------------------------------------------------------------------------------


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


# ---- lines of code -----------------------------------------------------------------------------


def source_lines(obj: Any) -> int:
    """Non-blank lines of `obj`'s source that are neither comments nor docstrings."""
    source = textwrap.dedent(inspect.getsource(obj))
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docstrings.update(range(body[0].lineno, (body[0].end_lineno or 0) + 1))
    return sum(
        1
        for i, line in enumerate(source.splitlines(), 1)
        if line.strip() and not line.strip().startswith("#") and i not in docstrings
    )


def backend_classes(cls: type[AttentionBackend]) -> list[type]:
    """The classes a backend is made of: the four legacy ones behind an adapter, else itself."""
    legacy = getattr(cls, "legacy_backend", None)
    if legacy is None:
        return [cls]
    return [legacy, legacy.get_builder_cls(), legacy.get_metadata_cls(), legacy.get_impl_cls()]


def lines_of_code(cls: type[AttentionBackend]) -> dict[str, Any]:
    classes = backend_classes(cls)
    per_class = {c.__qualname__: source_lines(c) for c in classes}
    modules = {inspect.getmodule(c) for c in classes}
    return {
        "classes": per_class,
        "total": sum(per_class.values()),
        "modules": sum(source_lines(m) for m in modules if m is not None),
    }


# ---- host time per step ------------------------------------------------------------------------


def decode_engine(
    backend: str, model: str, num_requests: int, context: int, **kwargs: Any
) -> LLMEngine:
    """An engine whose `num_requests` requests are all past prefill, without running the model:
    only the scheduler and the runner's host side are driven. Give it `kv_cache_memory` for
    `num_requests * (context + steps)` tokens (see `decode_budget`)."""
    engine = LLMEngine(
        model,
        backend=backend,
        max_num_seqs=num_requests,
        max_num_batched_tokens=num_requests * context,
        enable_prefix_caching=False,
        **kwargs,
    )
    params = SamplingParams(max_tokens=engine.max_model_len - context, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request([(i * 7919 + j) % 256 for j in range(context)], params)
    engine.runner.prepare_inputs(engine.scheduler.schedule())  # one prefill step: rows assigned
    return engine


def decode_budget(probe: LLMEngine, num_requests: int, tokens: int) -> int:
    """KV bytes for `num_requests` requests of `tokens` tokens in every group of `probe`'s model."""
    plan = probe.worker.plan
    blocks = num_requests * len(plan.groups) * (-(-tokens // plan.block_size) + 1) + 8
    return plan.bytes_per_block * blocks


def time_decode_step(engine: LLMEngine, token: int) -> tuple[float, float]:
    """One more decode step (every running request gets `token`): µs of
    `runner.prepare_inputs` and of the flat `prep_forward` loop. Scheduling is not timed, and
    engines in the same state see identical scheduler outputs."""
    runner, scheduler = engine.runner, engine.scheduler
    for request in scheduler.running:
        request.append_output_token_ids(token)
    output = scheduler.schedule()
    t0 = time.perf_counter_ns()
    common, tables, _ids, _sample = runner.prepare_inputs(output)
    t1 = time.perf_counter_ns()
    for backend, gids in runner.backend_groups:
        backend.prep_forward(common, {gid: tables[gid] for gid in gids})
    if common.positions.is_cuda:
        torch.cuda.synchronize()
    t2 = time.perf_counter_ns()
    return (t1 - t0) / 1e3, (t2 - t1) / 1e3


def time_prep_forward(
    engines: dict[str, LLMEngine], steps: int, warmup: int = 3
) -> dict[str, dict[str, list[float]]]:
    """Per engine, µs per decode step of `prepare_inputs` and `prep_forward`; the engines take
    turns every step (in alternating order) so that drift on the machine hits them alike."""
    times: dict[str, dict[str, list[float]]] = {
        side: {"prepare_inputs": [], "prep_forward": []} for side in engines
    }
    sides = list(engines)
    for step in range(warmup + steps):
        for side in sides if step % 2 else sides[::-1]:
            prepare, prep = time_decode_step(engines[side], step % 256)
            if step >= warmup:
                times[side]["prepare_inputs"].append(prepare)
                times[side]["prep_forward"].append(prep)
    return times


def host_time(
    names: dict[str, str], model: str, probe: LLMEngine, num_requests: int = 64
) -> dict[str, Any]:
    context, steps = 128, 20
    kwargs = {
        "device": probe.config.device,
        "dtype": probe.config.dtype,
        "max_model_len": 2 * context,
        "kv_cache_memory": decode_budget(probe, num_requests, context + steps + 4),
    }
    engines = {
        side: decode_engine(name, model, num_requests, context, **kwargs)
        for side, name in names.items()
    }
    medians = {
        side: {key: statistics.median(values) for key, values in times.items()}
        for side, times in time_prep_forward(engines, steps).items()
    }
    return {
        "what": f"median µs per decode step ({num_requests} requests, {context}-token context) "
        "of runner.prepare_inputs and of the prep_forward loop; no model forward",
        **medians,
        "prep_forward_ratio": medians["legacy"]["prep_forward"] / medians["native"]["prep_forward"],
    }


# ---- the harness -------------------------------------------------------------------------------


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
    classes = {
        "legacy": resolve_any_backend(legacy, legacy=True),
        "native": resolve_any_backend(native),
    }
    names = {side: engine_backend_name(cls) for side, cls in classes.items()}
    kwargs = engine_kwargs(workload, device, dtype, seed)
    probe = LLMEngine(model, backend=names["native"], **kwargs)
    kwargs["kv_cache_memory"] = kv_budget(probe, workload.spare_blocks)
    prompts = workload.prompts(probe.vocab_size)
    runs = {
        side: run_workload(LLMEngine(model, backend=name, **kwargs), prompts, workload.max_tokens)
        for side, name in names.items()
    }
    tol = atol if atol is not None else DEFAULT_ATOL[probe.model.dtype]
    steps = compare_outputs(runs["legacy"].outputs, runs["native"].outputs, tol)
    covered = {side: coverage(run, workload, prompts) for side, run in runs.items()}
    failures = [step_failure(r, tol) for r in steps if not r["ok"]]
    failures += [
        f"the workload did not exercise {key} ({side})"
        for side, cov in covered.items()
        for key in REQUIRED_COVERAGE
        if not cov[key]
    ]
    report = {
        "ok": not failures,
        "failures": failures,
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
        report["host_time"] = host_time(names, model, probe)
    return report


# ---- the `unified-attn migrate` command --------------------------------------------------------


def add_parser(commands: Any) -> None:
    migrate = commands.add_parser(
        "migrate", help="compare a legacy backend (through the adapter) with a native one"
    )
    migrate.add_argument("--legacy", required=True, help="legacy NAME or module:Class")
    migrate.add_argument("--native", required=True, help="native NAME or module:Class")
    migrate.add_argument("--model", default="tiny-hybrid", help="preset name or checkpoint path")
    migrate.add_argument("--device", default="cpu")
    migrate.add_argument("--dtype", default="float32")
    migrate.add_argument("--atol", type=float, default=None, help="default: 1e-4 for float32")
    migrate.add_argument("--seed", type=int, default=0)
    migrate.add_argument("--small", action="store_true", help="a 3-request workload")
    migrate.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    migrate.add_argument("--json", action="store_true", help="print the report as JSON only")
    migrate.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    from unified_attn.harness.conformance import prepare_cli

    prepare_cli(args.device, args.threads)
    report = run_migration(
        args.legacy,
        args.native,
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        atol=args.atol,
        seed=args.seed,
        workload=SMALL_WORKLOAD if args.small else None,
    )
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print_report(report)
    return 0 if report["ok"] else 1


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    title = (
        f"{report['legacy']['backend']} (legacy, adapter) vs {report['native']['backend']}"
        f" on {report['model']} / {report['device']} {report['dtype']}"
    )
    steps = Table(title=title, title_justify="left")
    for column in ("token", "requests", "max |logit diff|", "token mismatches", "ties", "ok"):
        steps.add_column(column, justify="right")
    for r in report["steps"]:
        steps.add_row(
            str(r["token_index"]),
            str(r["requests"]),
            f"{r['max_abs_logit_diff']:.3g}",
            str(r["token_mismatches"]),
            str(r["ties"]),
            "[green]yes" if r["ok"] else "[red]NO",
        )
    console.print(steps)
    summary = Table(show_header=False, title="Summary", title_justify="left")
    cov = report["coverage"]["native"]
    loc = report["lines_of_code"]
    rows = [
        ("atol", f"{report['atol']:g}"),
        ("coverage", ", ".join(f"{k} {v}" for k, v in cov.items())),
        (
            "lines of code",
            f"legacy {loc['legacy']['total']} (4 classes), native "
            f"{loc['native']['total']}, adapter {loc['adapter (shared)']}",
        ),
        (
            "engine step (ms, median)",
            ", ".join(f"{k} {v:.1f}" for k, v in report["engine_step_ms"].items()),
        ),
    ]
    if "host_time" in report:
        host = report["host_time"]
        rows.append(
            (
                "prep_forward (µs)",
                f"legacy {host['legacy']['prep_forward']:.0f}, native "
                f"{host['native']['prep_forward']:.0f} (x{host['prep_forward_ratio']:.2f})",
            )
        )
    rows.append(
        ("result", "[green]PASS" if report["ok"] else "[red]FAIL: " + "; ".join(report["failures"]))
    )
    for key, value in rows:
        summary.add_row(key, value)
    console.print(summary)
