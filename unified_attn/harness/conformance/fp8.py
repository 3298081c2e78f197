"""fp8 KV-cache cells (`FP8_GRID`): a backend with `kv_cache_dtype="fp8"` against attention over
its own cache dequantized, plus what the cache must hold.

Per step, independently of the backend's code:

- **scales**: the cell's checkpoint scales (passed as the `kv_scales` forward kwarg), else
  calibrated on the first step: `amax / 448` of that step's keys (values), in float32;
- **"fp8 cache write"**: every slot the step wrote holds exactly
  `float8_e4m3fn(clamp(x / scale, -448, 448))` of its key and value (bitwise);
- **output** (`max_err`, against the model dtype's `TOL`): the reference attention math
  (`backends.reference.attend`, float32) over the keys and values gathered from the backend's
  cache through the step's block table and dequantized as `stored * scale`;
- **"fp8 vs unquantized"**: the output within `FP8_VS_UNQUANTIZED * max |value|` of the
  reference backend on a cache of the model dtype (the quantization error a user sees), except
  in the saturation cell, whose new keys are louder than the calibration step on purpose.
"""

from __future__ import annotations

import itertools

import attrs
import torch

from unified_attn.backend import AttentionBackend, require_cache_config
from unified_attn.backends.reference import ReferenceAttentionBackend, attend
from unified_attn.harness.conformance.cells import Cell
from unified_attn.harness.conformance.checks import check_bad_inputs
from unified_attn.harness.conformance.driver import bind, run_step
from unified_attn.harness.conformance.oracle import largest_error
from unified_attn.harness.conformance.steps import GROUP_ID, Step, make_steps

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Max |fp8 output - output over the unquantized cache|, relative to the largest |value| of the
# cell: one e4m3 step at the top of the range (3 mantissa bits: 2^-3). A value at the calibrated
# amax is off by up to half of that; the measured worst over FP8_GRID and seeds 0-15 is 0.075.
FP8_VS_UNQUANTIZED = 0.125


def compare_fp8(
    backend_cls: type[AttentionBackend], cell: Cell, device: str, seed: int, checks: dict
) -> tuple[float, str]:
    """Run the cell's steps on the backend: the largest error against its dequantized cache and
    where it is; the fp8 checks go into `checks`."""
    steps, num_blocks = make_steps(cell, device, seed)
    sinks = torch.randn(cell.num_heads, generator=torch.Generator().manual_seed(seed + 1))
    sinks_dev = sinks.to(device) if cell.sinks else None
    backend = backend_cls(**cell.backend_kwargs())
    checks["fp8 page"] = check_fp8_page(backend, cell)
    view = bind(backend, cell, num_blocks, seed + 2, device)
    plain = attrs.evolve(cell, kv_cache_dtype="auto", kv_scales=None, new_kv_gain=1.0)
    unquantized = ReferenceAttentionBackend(**plain.backend_kwargs())
    bind(unquantized, plain, num_blocks, seed + 3, device)
    given = None if cell.kv_scales is None else torch.tensor(cell.kv_scales, device=device)
    extra = {} if given is None else {"kv_scales": given}
    scales = given.cpu() if given is not None else first_step_scales(steps[0])
    worst, worst_unq, writes = (-1.0, ""), 0.0, "pass"
    for i, step in enumerate(steps):
        last = i == len(steps) - 1
        got = run_step(backend, cell, step, sinks_dev, checks if last else {}, extra)
        if writes == "pass":
            writes = check_fp8_writes(view, cell, step, scales)
        expected = dequantized_attention(view, cell, step, scales, sinks)
        worst = max(worst, largest_error(got, expected, step, cell, i, len(steps)))
        reference = run_step(unquantized, plain, step, sinks_dev)
        worst_unq = max(worst_unq, (got.cpu().float() - reference.cpu().float()).abs().max().item())
    checks["fp8 cache write"] = writes
    v_amax = max(step.value.abs().max().item() for step in steps)
    checks["fp8 vs unquantized"] = check_unquantized(cell, worst_unq, v_amax)
    checks["rejects bad inputs"] = check_bad_inputs(backend, cell, steps[-1])
    return worst


def check_fp8_page(backend: AttentionBackend, cell: Cell) -> str:
    """The spec stores float8 e4m3: one byte per element, `2 * bs * Hkv * D` per page."""
    _, _, spec = require_cache_config(backend)
    expected = 2 * cell.block_size * cell.num_kv_heads * cell.head_size
    page = spec.page_size_bytes(cell.block_size)
    if getattr(spec, "dtype", None) != FP8 or page != expected:
        return f"fail: expected a {FP8} page of {expected} bytes, got {spec} ({page} bytes)"
    return "pass"


def first_step_scales(step: Step) -> torch.Tensor:
    """`[2]` float32: amax / 448 of the first step's keys and values (all of them have a slot);
    1.0 for an all-zero tensor."""
    amax = torch.stack([step.key.abs().amax(), step.value.abs().amax()]).cpu().float()
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The cache's definition: `e4m3(clamp(x / scale, -448, 448))`, round to nearest even."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def check_fp8_writes(view: torch.Tensor, cell: Cell, step: Step, scales: torch.Tensor) -> str:
    """Every slot of the step holds its quantized key and value, bit for bit."""
    slots = step.common.slot_mappings[GROUP_ID].cpu()
    blocks, offsets = slots // cell.block_size, slots % cell.block_size
    cache = view.cpu()
    for which, (name, rows) in enumerate((("key", step.key), ("value", step.value))):
        expected = quantize(rows.cpu().view(-1, cell.num_kv_heads, cell.head_size), scales[which])
        stored = cache[blocks, which, offsets]
        bad = (stored.view(torch.uint8) != expected.view(torch.uint8)).any(-1).any(-1)
        if bad.any():
            token = int(torch.nonzero(bad)[0])
            return (
                f"fail: the {name} of token row {token} (slot {int(slots[token])}) is "
                f"{stored[token].flatten()[:4].tolist()}..., expected "
                f"{expected[token].flatten()[:4].tolist()}... (scale {float(scales[which]):.4g})"
            )
    return "pass"


def dequantized_attention(
    view: torch.Tensor, cell: Cell, step: Step, scales: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """`[T, Hq * D]` float32: each request's queries over its keys and values read from the
    cache through the step's block table, as `stored * scale`."""
    assert step.block_table is not None
    layer, cache, table = cell.layer(), view.cpu(), step.block_table.cpu().long()
    q = step.query.cpu().float().view(-1, cell.num_heads, cell.head_size)
    starts = step.common.query_start_loc_cpu.tolist()
    seq_lens = step.common.seq_lens_cpu.tolist()
    out = torch.empty_like(q)
    for row, (start, end) in enumerate(itertools.pairwise(starts)):
        pos = torch.arange(seq_lens[row])
        blocks, offsets = table[row, pos // cell.block_size], pos % cell.block_size
        k = cache[blocks, 0, offsets].float() * scales[0]
        v = cache[blocks, 1, offsets].float() * scales[1]
        computed = seq_lens[row] - (end - start)
        out[start:end] = attend(layer, q[start:end], k, v, computed, sinks if cell.sinks else None)
    return out.view(step.query.shape)


def check_unquantized(cell: Cell, error: float, v_amax: float) -> str:
    """The fp8 output's distance from the output over an unquantized cache, against
    `FP8_VS_UNQUANTIZED` of the cell's largest |value| `v_amax`."""
    if cell.new_kv_gain != 1.0:
        return f"not compared: the cell saturates on purpose (max diff {error:.3g})"
    bound = FP8_VS_UNQUANTIZED * v_amax
    if error > bound:
        return (
            f"fail: max diff {error:.3g} from the unquantized cache > {bound:.3g} "
            f"({FP8_VS_UNQUANTIZED} of the largest |value| {v_amax:.3g})"
        )
    return "pass"
