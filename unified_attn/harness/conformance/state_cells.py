"""Conformance of recurrent-state backends (`layer_kinds` containing "linear_state").

A state cell runs several steps of a batch (prefill, chunked prefill, decode, mixed) through the
contract: `get_cache_config` must name `StateManager` with a `StateSpec`; the state blocks are
strided views over garbage; each step's block table holds random block ids at the positions the
manager's mode uses (mode "align": the state after n tokens at `(n - 1) // block_size`; mode
"none": column 0). The oracle is the gated linear recurrence written token by token in float64,
`S_t = g_t S_{t-1} + k_t^T v_t`, `o_t = scale q_t S_t`, independent of any chunked form; the
outputs of every step and the state left in the written block are compared with it.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import torch

from unified_attn.backend import (
    AttentionBackend,
    CommonAttentionMetadata,
    LayerConfig,
    require_cache_config,
)
from unified_attn.harness.conformance.cells import LAYER
from unified_attn.harness.conformance.checks import (
    NOT_MEASURABLE,
    cell_result,
    check_in_place,
    measure_cuda,
)
from unified_attn.harness.conformance.steps import GROUP_ID, batch_metadata
from unified_attn.managers import StateManager
from unified_attn.selector import SelectorConfig, backend_reasons
from unified_attn.tensor_specs import StateSpec
from unified_attn.utils import cdiv

STATE_TOL = 1e-4  # float32 against the float64 recurrence


@attrs.frozen
class StateCell:
    name: str
    # new tokens of each request in each step (0: the request is not in that step)
    steps: tuple[tuple[int, ...], ...]
    num_heads: int = 2
    head_size: int = 16
    block_size: int = 4
    mode: str = "align"

    def layer(self) -> LayerConfig:
        heads, size = self.num_heads, self.head_size
        return LayerConfig(LAYER, heads, heads, size, scale=size**-0.5)

    def backend_kwargs(self) -> dict[str, Any]:
        return {
            "num_heads": self.num_heads,
            "head_size": self.head_size,
            "dtype": torch.float32,
            "mamba_cache_mode": self.mode,
        }

    def selector_config(self, device: str) -> SelectorConfig:
        return SelectorConfig(
            head_size=self.head_size,
            dtype=torch.float32,
            block_size=self.block_size,
            device=device,
            use_batch_invariant=False,
            layer_kind="linear_state",
        )


STATE_GRID = (
    StateCell("state: prefill", steps=((7, 12),)),
    StateCell("state: prefill, decode", steps=((7, 12), (1, 1), (1, 1))),
    StateCell("state: chunked prefill, mixed", steps=((5, 8, 0), (3, 1, 6), (1, 4, 1))),
    StateCell("state: mode none", steps=((5, 8), (1, 1), (2, 1)), mode="none"),
    StateCell("state: 4 heads of 32", steps=((6, 3), (1, 5)), num_heads=4, head_size=32),
)


def run_state_cell(
    backend_cls: type[AttentionBackend], cell: StateCell, device: str, seed: int = 0
) -> dict[str, Any]:
    """One state cell: `status` pass / fail / unsupported, `max_err`, the contract `checks`."""
    row: dict[str, Any] = {
        "cell": cell.name,
        "type": "linear_state",
        "tol": STATE_TOL,
        "max_err": None,
    }
    reasons = backend_reasons(backend_cls, cell.selector_config(device))

    def checked(checks: dict[str, str]) -> tuple[float, str]:
        if torch.device(device).type == "cuda":
            # A state update cannot run twice, so the warm-up (library workspaces, kernel
            # compilation) is a whole throwaway run of the cell before the measured one.
            _compare(backend_cls, cell, device, seed, {})
        return _compare(backend_cls, cell, device, seed, checks)

    return cell_result(row, reasons, checked)


def _compare(
    backend_cls: type[AttentionBackend], cell: StateCell, device: str, seed: int, checks: dict
) -> tuple[float, str]:
    gen = torch.Generator().manual_seed(seed)
    backend = backend_cls(**cell.backend_kwargs())
    checks["cache config pure"] = _check_cache_config(backend_cls, cell)
    states, num_blocks = _bind(backend, cell, device, gen)
    table = _random_table(cell, num_blocks, gen)
    oracle = [torch.zeros(cell.num_heads, cell.head_size, cell.head_size, dtype=torch.float64)
              for _ in cell.steps[0]]  # fmt: skip
    done = [0] * len(cell.steps[0])
    worst = (-1.0, "")
    for index, new in enumerate(cell.steps):
        rows = [i for i, n in enumerate(new) if n]
        tensors = _random_inputs(cell, sum(new), gen)
        common = _common(cell, rows, done, new, device)
        backend.prep_forward(common, {GROUP_ID: table[rows].to(device)})
        output = torch.full_like(tensors["q"], float("nan")).to(device)
        forward = functools.partial(
            backend.forward, cell.layer(), output, *(tensors[n].to(device) for n in "qkv"),
            log_gate=tensors["log_gate"].to(device),
        )  # fmt: skip
        last = index == len(cell.steps) - 1
        _forward_with_checks(backend, forward, output, checks if last else None)
        expected = _oracle_step(cell, rows, new, tensors, oracle)
        err = (output.cpu().double() - expected).abs().nan_to_num(float("inf"))
        if err.max().item() > worst[0]:
            worst = (err.max().item(), f"(step {index + 1}/{len(cell.steps)}, outputs)")
        for i in rows:
            done[i] += new[i]
            held = states[int(table[i, _state_column(cell, done[i])])].cpu().double()
            state_err = (held - oracle[i]).abs().max().item()
            if state_err > worst[0]:
                worst = (state_err, f"(step {index + 1}/{len(cell.steps)}, state of request {i})")
    checks["rejects bad inputs"] = _check_bad_inputs(backend, cell, tensors, device)
    return worst


def _check_bad_inputs(
    backend: AttentionBackend, cell: StateCell, tensors: dict, device: str
) -> str:
    """A key missing a column must raise ValueError (before any state changes)."""
    q, k, v = (tensors[n].to(device) for n in "qkv")
    try:
        backend.forward(
            cell.layer(), torch.empty_like(q), q, k[:, :-1], v, log_gate=tensors["log_gate"]
        )
    except ValueError:
        return "pass"
    except Exception as error:  # any other type breaks the contract
        return f"fail: a key with a missing column raised {type(error).__name__}, not ValueError"
    return "fail: a key with a missing column was accepted"


def _check_cache_config(backend_cls: type[AttentionBackend], cell: StateCell) -> str:
    a, b = backend_cls(**cell.backend_kwargs()), backend_cls(**cell.backend_kwargs())
    manager, config, spec = require_cache_config(a)
    if manager is not StateManager or not isinstance(spec, StateSpec):
        return f"fail: expected StateManager and a StateSpec, got {manager.__name__}, {spec}"
    if a.get_cache_config() != b.get_cache_config() or config.mamba_cache_mode != cell.mode:
        return "fail: equal instances gave different triples (or the wrong mode)"
    return "pass"


def _bind(
    backend: AttentionBackend, cell: StateCell, device: str, gen: torch.Generator
) -> tuple[torch.Tensor, int]:
    """State views over garbage, block stride twice the page, offset one page."""
    _, _, spec = require_cache_config(backend)
    num_blocks = sum(cdiv(sum(n[i] for n in cell.steps), cell.block_size)
                     for i in range(len(cell.steps[0]))) + 4  # fmt: skip
    page = spec.page_size_bytes(cell.block_size)
    buffer = torch.empty(2 * page * (num_blocks + 1), dtype=torch.uint8)
    buffer.view(torch.float32).copy_(torch.randn(buffer.numel() // 4, generator=gen))
    views = spec.make_view(buffer.to(device), page, 2 * page, num_blocks, cell.block_size)
    backend.bind_kv_caches({LAYER: views}, {LAYER: GROUP_ID})
    return views[0], num_blocks


def _random_table(cell: StateCell, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct random block ids (never the null block) at every position a request uses."""
    totals = [sum(n[i] for n in cell.steps) for i in range(len(cell.steps[0]))]
    width = max(cdiv(t, cell.block_size) for t in totals) + 1
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(totals), width, dtype=torch.int32)
    for i, total in enumerate(totals):
        count = 1 if cell.mode == "none" else cdiv(total, cell.block_size)
        table[i, :count] = torch.tensor(ids[:count], dtype=torch.int32)
        ids = ids[count:]
    return table


def _state_column(cell: StateCell, num_tokens: int) -> int:
    return 0 if cell.mode == "none" else (num_tokens - 1) // cell.block_size


def _random_inputs(cell: StateCell, num_tokens: int, gen: torch.Generator) -> dict:
    shape = (num_tokens, cell.num_heads * cell.head_size)
    return {
        "q": torch.randn(shape, generator=gen),
        "k": torch.nn.functional.normalize(torch.randn(shape, generator=gen), dim=-1),
        "v": torch.randn(shape, generator=gen),
        "log_gate": torch.nn.functional.logsigmoid(
            torch.randn(num_tokens, cell.num_heads, generator=gen) + 2.0
        ),
    }


def _common(
    cell: StateCell, rows: list[int], done: list[int], new: tuple[int, ...], device: str
) -> CommonAttentionMetadata:
    """Requests `rows` with `new[i]` tokens after `done[i]`; no slots (state layers write
    their blocks, not token slots)."""
    end = [d + n for d, n in zip(done, new, strict=True)]
    num_tokens = sum(new[i] for i in rows)
    slots = {GROUP_ID: torch.full((num_tokens,), -1, device=device)}
    return batch_metadata(done, end, rows, slots, device, {GROUP_ID: cell.block_size})


def _forward_with_checks(
    backend: AttentionBackend, forward: Any, output: torch.Tensor, checks: dict | None
) -> None:
    """One `forward` call (a state update must happen exactly once), with the contract checks
    recorded into `checks` when given."""
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


def _oracle_step(
    cell: StateCell, rows: list[int], new: tuple[int, ...], tensors: dict, states: list
) -> torch.Tensor:
    """Token by token in float64; updates `states` in place; outputs `[T, H * D]`."""
    heads, size, scale = cell.num_heads, cell.head_size, cell.head_size**-0.5
    q, k, v = (tensors[n].double().view(-1, heads, size) for n in "qkv")
    gate = tensors["log_gate"].double().exp()
    out = torch.empty_like(q)
    token = 0
    for i in rows:
        for _ in range(new[i]):
            kv = k[token][:, :, None] * v[token][:, None, :]  # [H, D, D]
            states[i] = gate[token][:, None, None] * states[i] + kv
            out[token] = scale * torch.einsum("hd,hde->he", q[token], states[i])
            token += 1
    return out.view(-1, heads * size)
