"""The oracle of the cells without a decoder cache, independent of every backend:
`torch.nn.functional.scaled_dot_product_attention` per request, non-causal, in float64 on the
host, over the very inputs the backend got (already rounded to the cell's dtype).

`compare_encoder`: encoder and encoder-only cells, one packed pass over whole inputs; nothing is
bound and `prep_forward` gets no block tables. `compare_cross`: cross cells, the backend's cache
bound over garbage, step after step; each request's queries attend to all of its encoder keys,
so a later step (E = 0) shows whether the keys written earlier are read back from the cache.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from unified_attn.backend import AttentionBackend, LayerConfig
from unified_attn.harness.conformance.cells import Cell, CrossCell
from unified_attn.harness.conformance.checks import check_bad_inputs
from unified_attn.harness.conformance.cross import make_cross_steps
from unified_attn.harness.conformance.driver import bind, run_step
from unified_attn.harness.conformance.oracle import largest_error
from unified_attn.harness.conformance.steps import Step, encoder_step


def sdpa(layer: LayerConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Queries `[L, Hq, D]` over keys/values `[S, Hkv, D]` (query head h reads KV head
    `h // (Hq / Hkv)`), no mask, in float64 on the host: `[L, Hq * D]`."""
    group = layer.num_heads // layer.num_kv_heads
    q64 = q.cpu().double().transpose(0, 1)  # [Hq, L, D]
    k64, v64 = (t.cpu().double().repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
    out = F.scaled_dot_product_attention(q64, k64, v64, scale=layer.scale)  # [Hq, L, D]
    return out.transpose(0, 1).flatten(1)


def heads(cell: Cell | CrossCell, step: Step) -> tuple[torch.Tensor, ...]:
    """The step's query `[T, Hq, D]`, key and value `[T or E, Hkv, D]`."""
    size = cell.head_size
    return tuple(
        t.view(t.shape[0], t.shape[1] // size, size) for t in (step.query, step.key, step.value)
    )


def compare_encoder(
    backend_cls: type[AttentionBackend], cell: Cell, device: str, seed: int, checks: dict
) -> tuple[float, str]:
    """One encoder pass on the backend; each request attends over its own tokens."""
    step = encoder_step(cell, device, seed)
    backend = backend_cls(**cell.backend_kwargs())
    got = run_step(backend, cell, step, None, checks)
    q, k, v = heads(cell, step)
    starts = step.common.query_start_loc_cpu.tolist()
    ranges = list(itertools.pairwise(starts))
    expected = torch.cat([sdpa(cell.layer(), q[a:b], k[a:b], v[a:b]) for a, b in ranges])
    checks["rejects bad inputs"] = check_bad_inputs(backend, cell, step)
    return largest_error(got, expected, step, cell, 0, 1)


def compare_cross(
    backend_cls: type[AttentionBackend], cell: CrossCell, device: str, seed: int, checks: dict
) -> tuple[float, str]:
    """The cell's steps on the backend; each request's queries over its whole encoder."""
    steps, kv, num_blocks = make_cross_steps(cell, device, seed)
    backend = backend_cls(**cell.backend_kwargs())
    bind(backend, cell, num_blocks, seed + 2, device)
    worst = (-1.0, "")
    for index, step in enumerate(steps):
        last = index == len(steps) - 1
        got = run_step(backend, cell, step, None, checks if last else {})
        q = heads(cell, step)[0]
        starts = step.common.query_start_loc_cpu.tolist()
        expected = torch.cat([
            sdpa(cell.layer(), q[a:b], kv[i][0], kv[i][1])
            for i, (a, b) in zip(step.requests, itertools.pairwise(starts), strict=True)
        ])  # fmt: skip
        error = largest_error(got, expected, step, cell, index, len(steps))
        worst = max(worst, error, key=lambda e: e[0])
    checks["rejects bad inputs"] = check_bad_inputs(backend, cell, steps[-1])
    return worst
