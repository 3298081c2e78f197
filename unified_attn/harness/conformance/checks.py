"""The contract checks besides the outputs, each a "pass" / "fail: ..." / note string: a pure
`get_cache_config` of the cell's kind (None for encoder and encoder-only layers, the
cross-attention manager for cross layers), in-place output, ValueError on bad inputs, and on
CUDA no host sync and no allocation in `forward` (`NOT_MEASURABLE` on CPU)."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from unified_attn.backend import AttentionBackend, CacheConfig
from unified_attn.harness.conformance.cells import NO_CACHE_TYPES, AttentionCell, CrossCell
from unified_attn.harness.conformance.steps import Step
from unified_attn.managers import CrossAttentionManager

NOT_MEASURABLE = "not measurable on CPU"


def cell_result(
    row: dict[str, Any],
    reasons: list[str],
    compare: Callable[[dict[str, str]], tuple[float, str]],
) -> dict[str, Any]:
    """A cell's row finished: "unsupported" with the backend's `reasons`, else `compare(checks)`
    run (it fills the contract `checks` and returns the largest error and where it is): "fail"
    when it raised, the error exceeds `row["tol"]` or a check failed, else "pass"."""
    if reasons:
        return row | {"status": "unsupported", "detail": "; ".join(reasons), "checks": {}}
    checks: dict[str, str] = {}
    failed = []
    try:
        row["max_err"], location = compare(checks)
        if row["max_err"] > row["tol"]:
            failed.append(f"max error {row['max_err']:.3g} > {row['tol']:g} {location}".rstrip())
    except Exception as error:  # a crash fails the cell, not the run
        failed.append(crash(error))
        row["trace"] = "".join(traceback.format_exception(error))
    failed += [f"{k}: {v}" for k, v in checks.items() if v.startswith("fail")]
    return row | {"status": "fail" if failed else "pass", "detail": "; ".join(failed),
                  "checks": checks}  # fmt: skip


HARNESS = str(Path(__file__).resolve().parents[1])  # unified_attn/harness


def crash(error: BaseException) -> str:
    """A crash in one line, with where it happened: the deepest frame outside the harness and
    the libraries (the backend's or manager's own code, when it is there)."""
    frames = [
        f for f in traceback.extract_tb(error.__traceback__)
        if not f.filename.startswith(HARNESS) and "site-packages" not in f.filename
    ]  # fmt: skip
    where = f" (in {Path(frames[-1].filename).name}:{frames[-1].lineno}, {frames[-1].name})"
    return f"raised {type(error).__name__}: {error}{where if frames else ''}"


def check_cache_config(backend_cls: type[AttentionBackend], cell: AttentionCell) -> str:
    a, b = backend_cls(**cell.backend_kwargs()), backend_cls(**cell.backend_kwargs())
    config = a.get_cache_config()
    if config != a.get_cache_config():
        return "fail: two calls gave different triples"
    if config != b.get_cache_config():
        return "fail: equal instances gave different triples"
    return check_cache_kind(cell, config)


def check_cache_kind(cell: AttentionCell, config: CacheConfig | None) -> str:
    """No cache for encoder and encoder-only layers, `CrossAttentionManager` sized by
    `max_encoder_len` for cross layers, some cache for decoder layers."""
    kind = cell.attn_type.value
    found = "None" if config is None else f"({config[0].__name__}, {config[1]}, ...)"
    if cell.attn_type in NO_CACHE_TYPES:
        expected = "None (the layer keeps no KV cache)"
        ok = config is None
    elif isinstance(cell, CrossCell):
        cross = CrossAttentionManager.Config(cell.max_encoder_len)
        expected = f"(CrossAttentionManager, {cross}, spec)"
        ok = config is not None and config[:2] == (CrossAttentionManager, cross)
    else:
        expected = "a (manager, config, spec) triple"
        ok = config is not None
    return "pass" if ok else f"fail: attn_type={kind} expects {expected}, got {found}"


def check_in_place(result: Any, output: torch.Tensor) -> str:
    """`forward` must write `output` and return it (the same tensor, or one at the same address)."""
    same = result is output or (
        isinstance(result, torch.Tensor) and result.data_ptr() == output.data_ptr()
    )
    return "pass" if same else "fail: forward did not return `output`"


def check_bad_inputs(backend: AttentionBackend, cell: AttentionCell, step: Step) -> str:
    layer, out = cell.layer(), torch.empty_like(step.query)
    return refuses_each({
        "key with a missing column": lambda: backend.forward(
            layer, out, step.query, step.key[:, :-1], step.value),
        "query in the wrong dtype": lambda: backend.forward(
            layer, out, step.query.to(torch.float64), step.key, step.value),
    })  # fmt: skip


def refuses_each(bad: dict[str, Callable[[], Any]]) -> str:
    """"pass" when every call in `bad` raises ValueError, else the first that did not."""
    for what, call in bad.items():
        try:
            call()
        except ValueError:
            continue
        except Exception as error:  # any other type breaks the contract
            return f"fail: {what} raised {type(error).__name__}, not ValueError"
        return f"fail: {what} was accepted"
    return "pass"


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
