"""Conformance of multi-head latent attention backends (`layer_kinds` containing "mla").

An `MLACell` is a batch of requests (`computed` tokens already in the cache, `new` ones in the
cell's step) through the MLA contract (`backends/mla.py`): one latent `[c_kv (L), k_pe (R)]`
per token as key and value of every head, queries `[T, H, N + R]`, the layer's up-projection
`kv_b_proj [H * (N + V), L]` as a forward keyword, outputs `[T, H * V]`. The latent cache is a
strided view over garbage and the block tables are random, as for the attention cells; the
history step (the computed tokens) runs first, then the cell's batch.

The oracle is independent of every backend: per request, the keys `[W_UK c, k_pe]` and values
`W_UV c` of every cached latent are up-projected explicitly and attended causally (within the
window, if any) by `scaled_dot_product_attention` in float64 on the host, over the very inputs
the backend got. Besides the outputs: `get_cache_config` is pure and returns a latent spec of
`L + R` features, the output is written in place and returned, bad inputs raise ValueError, and
on CUDA `forward` neither syncs nor allocates.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.nn.functional as F

from unified_attn.backend import AttentionBackend, LayerConfig
from unified_attn.backends.kv_quant import dequantize_fp8, quantize_fp8
from unified_attn.harness.conformance.checks import (
    NOT_MEASURABLE,
    cell_result,
    check_in_place,
    measure_cuda,
    refuses_each,
)
from unified_attn.harness.conformance.driver import bind
from unified_attn.harness.conformance.steps import GROUP_ID, batch_metadata, random_table
from unified_attn.selector import SelectorConfig, backend_reasons
from unified_attn.tensor_specs import LatentKVSpec
from unified_attn.utils import cdiv

MLA_TOL = {torch.float32: 2e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@attrs.frozen
class MLACell:
    name: str
    computed: tuple[int, ...]
    new: tuple[int, ...]
    num_heads: int = 4
    nope: int = 16  # qk_nope_head_dim N
    rope: int = 16  # qk_rope_head_dim R
    kv_lora_rank: int = 32  # L
    v_head: int = 16  # v_head_dim V
    block_size: int = 16
    sliding_window: int | None = None
    dtype: torch.dtype = torch.float32
    kv_cache_dtype: str = "auto"  # "fp8": the latent cache is e4m3 under FP8_SCALE

    @property
    def width(self) -> int:
        return self.kv_lora_rank + self.rope

    def layer(self) -> LayerConfig:
        scale = (self.nope + self.rope) ** -0.5
        return LayerConfig("layers.0.self_attn", self.num_heads, 1, self.width, scale,
                           sliding_window=self.sliding_window)  # fmt: skip

    def backend_kwargs(self) -> dict[str, Any]:
        kwargs = {"head_size": self.width, "dtype": self.dtype, "kv_lora_rank": self.kv_lora_rank,
                  "sliding_window": self.sliding_window}  # fmt: skip
        return kwargs if self.kv_cache_dtype == "auto" else {**kwargs, "kv_cache_dtype": "fp8"}

    def selector_config(self, device: str) -> SelectorConfig:
        return SelectorConfig(head_size=self.width, dtype=self.dtype, block_size=self.block_size,
                              sliding_window=self.sliding_window, device=device,
                              use_batch_invariant=False, layer_kind="mla",
                              kv_cache_dtype=self.kv_cache_dtype)  # fmt: skip


def _mixed(name: str, **options: Any) -> MLACell:
    """A prefill, two decodes and a chunked prefill in one batch."""
    return MLACell(name, computed=(0, 17, 40, 5), new=(13, 1, 1, 20), **options)


MLA_GRID = (
    MLACell("mla: prefill", computed=(0, 0), new=(7, 12)),
    MLACell("mla: decode", computed=(5, 17, 33), new=(1, 1, 1)),
    _mixed("mla: mixed"),
    MLACell("mla: chunked prefill", computed=(16, 9, 3), new=(8, 5, 2)),
    _mixed("mla: sliding window 8", sliding_window=8),
    _mixed("mla: 16 heads, latent 64 + 32", num_heads=16, kv_lora_rank=64, rope=32),
    _mixed("mla: block size 8", block_size=8),
    _mixed("mla: mixed, fp8 latent cache", kv_cache_dtype="fp8"),
)
# The fp8 cell's latent scale, as a checkpoint gives it (the kv_scales forward keyword): small
# enough that the largest random latents saturate at 448.
FP8_SCALE = 0.008
CUDA_MLA_CELLS = tuple(
    attrs.evolve(c, name=f"{c.name}, bfloat16", dtype=torch.bfloat16)
    for c in MLA_GRID
    if c.name in ("mla: mixed", "mla: decode")
)


@attrs.frozen
class MLAStep:
    common: Any
    block_table: torch.Tensor
    query: torch.Tensor  # [T, H, N + R]
    latent: torch.Tensor  # [T, L + R]
    starts: list[int]
    ends: list[int]


def make_mla_steps(cell: MLACell, device: str, seed: int):
    """The history step (if any), the cell's step, each request's latents `[S_i, L + R]`, the
    up-projection weight and the block count."""
    gen = torch.Generator().manual_seed(seed)
    total = [c + n for c, n in zip(cell.computed, cell.new, strict=True)]
    table, num_blocks = random_table([cdiv(t, cell.block_size) for t in total], gen)
    latents = [torch.randn(t, cell.width, generator=gen) for t in total]
    weight = torch.randn(cell.num_heads * (cell.nope + cell.v_head), cell.kv_lora_rank,
                         generator=gen) * cell.kv_lora_rank**-0.5  # fmt: skip
    ranges = [([0] * len(total), list(cell.computed)), (list(cell.computed), total)]
    steps = []
    for start, end in ranges:
        rows = [i for i in range(len(total)) if end[i] > start[i]]
        if not rows:
            continue
        positions = torch.cat([torch.arange(start[i], end[i]) for i in rows])
        owners = torch.cat([torch.full((end[i] - start[i],), i) for i in rows])
        bs = cell.block_size
        slots = table[owners, positions // bs].long() * bs + positions % bs
        common = batch_metadata(start, end, rows, {GROUP_ID: slots.to(device)}, device)
        query = torch.randn(len(positions), cell.num_heads, cell.nope + cell.rope, generator=gen)
        latent = torch.cat([latents[i][start[i] : end[i]] for i in rows])
        q, c = (t.to(device, cell.dtype) for t in (query, latent))
        steps.append(MLAStep(common, table[rows].to(device), q, c, start, end))
    return steps, latents, weight, num_blocks


def stored_latents(cell: MLACell, latents: list[torch.Tensor]) -> list[torch.Tensor]:
    """What the cache holds of each request's latents, as the oracle reads them: rounded to the
    cell's dtype, or for an fp8 cell quantized with saturation and dequantized."""
    if cell.kv_cache_dtype == "auto":
        return latents
    scale = torch.tensor(FP8_SCALE)
    return [dequantize_fp8(quantize_fp8(c.to(cell.dtype), scale), scale) for c in latents]


def oracle(cell: MLACell, step: MLAStep, latents: list[torch.Tensor], weight: torch.Tensor):
    """float64 SDPA per request over explicitly up-projected keys and values: `[T, H * V]`."""
    h, n, v = cell.num_heads, cell.nope, cell.v_head
    w = weight.to(cell.dtype).double().view(h, n + v, cell.kv_lora_rank)
    w_uk, w_uv = w[:, :n], w[:, n:]  # [H, N, L], [H, V, L]
    outs, offset = [], 0
    for i, (start, end) in enumerate(zip(step.starts, step.ends, strict=True)):
        if end == start:
            continue
        c = latents[i][:end].to(cell.dtype).double()  # what the cache holds, rounded
        nope, pe = c[:, : cell.kv_lora_rank], c[:, cell.kv_lora_rank :]
        keys = torch.cat([torch.einsum("sl,hnl->hsn", nope, w_uk), pe.expand(h, -1, -1)], -1)
        values = torch.einsum("sl,hvl->hsv", nope, w_uv)
        q = step.query[offset : offset + end - start].cpu().double().transpose(0, 1)
        diff = torch.arange(start, end)[:, None] - torch.arange(end)
        allowed = (diff >= 0) & (diff < (cell.sliding_window or 1 << 30))
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed,
                                           scale=cell.layer().scale)  # fmt: skip
        outs.append(o.transpose(0, 1).flatten(1))
        offset += end - start
    return torch.cat(outs)


def check_mla_cache_config(backend_cls: type[AttentionBackend], cell: MLACell) -> str:
    a, b = backend_cls(**cell.backend_kwargs()), backend_cls(**cell.backend_kwargs())
    config = a.get_cache_config()
    if config != a.get_cache_config() or config != b.get_cache_config():
        return "fail: get_cache_config is not a pure function of the options"
    if (
        config is None
        or not isinstance(config[2], LatentKVSpec)
        or config[2].head_size != cell.width
    ):
        return f"fail: expected a LatentKVSpec of {cell.width} features, got {config}"
    return "pass"


def check_mla_bad_inputs(backend: AttentionBackend, cell: MLACell, step: MLAStep, weight) -> str:
    layer, out = cell.layer(), torch.empty(step.query.shape[0], cell.num_heads * cell.v_head,
                                           dtype=cell.dtype, device=step.query.device)  # fmt: skip
    q, c = step.query, step.latent
    return refuses_each({
        "latent with a missing column": lambda: backend.forward(
            layer, out, q, c[:, :-1], c[:, :-1], kv_b_proj=weight),
        "query in the wrong dtype": lambda: backend.forward(
            layer, out, q.to(torch.float64), c, c, kv_b_proj=weight),
        "kv_b_proj of the wrong shape": lambda: backend.forward(
            layer, out, q, c, c, kv_b_proj=weight[:-1]),
    })  # fmt: skip


def run_mla_cell(
    backend_cls: type[AttentionBackend], cell: MLACell, device: str, seed: int = 0
) -> dict[str, Any]:
    """One MLA cell: `status` pass / fail / unsupported, `max_err`, the contract `checks`."""
    tol = MLA_TOL[cell.dtype]
    row: dict[str, Any] = {"cell": cell.name, "type": "mla", "tol": tol, "max_err": None}
    reasons = backend_reasons(backend_cls, cell.selector_config(device))

    def checked(checks: dict[str, str]) -> tuple[float, str]:
        checks["cache config pure"] = check_mla_cache_config(backend_cls, cell)
        return _compare(backend_cls, cell, device, seed, checks), ""

    return cell_result(row, reasons, checked)


def _compare(backend_cls, cell: MLACell, device: str, seed: int, checks: dict) -> float:
    steps, latents, weight, num_blocks = make_mla_steps(cell, device, seed)
    backend = backend_cls(**cell.backend_kwargs())
    cache = bind(backend, cell, num_blocks, seed + 2, device)  # type: ignore[arg-type]
    w = weight.to(device, cell.dtype)
    fp8 = cell.kv_cache_dtype != "auto"
    extra = {"kv_scales": torch.full((2,), FP8_SCALE, device=device)} if fp8 else {}
    seen = stored_latents(cell, latents)
    worst = 0.0
    for i, step in enumerate(steps):
        backend.prep_forward(step.common, {GROUP_ID: step.block_table})
        out = torch.full((step.query.shape[0], cell.num_heads * cell.v_head), float("nan"),
                         dtype=cell.dtype, device=device)  # fmt: skip
        layer = cell.layer()

        def forward(out=out, step=step, layer=layer):
            return backend.forward(
                layer, out, step.query, step.latent, step.latent, kv_b_proj=w, **extra
            )

        if i == len(steps) - 1:
            if out.is_cuda:
                forward()  # warm-up: the measured call below is the same step
                # Temporaries are reported, not failed, even for a backend that claims CUDA
                # graphs: weight absorption's intermediates (absorbed queries, the latent output,
                # its projection) are per-call tensors by design, which a captured graph takes
                # from its private pool (tests/gpu/test_mla_triton_gpu.py replays such graphs).
                # Bytes kept after the call still fail.
                checks.update(measure_cuda(forward, strict_alloc=False))
            else:
                checks.update({"host sync": NOT_MEASURABLE, "allocation": NOT_MEASURABLE})
            checks["in-place output"] = check_in_place(forward(), out)
        else:
            forward()
        err = (out.cpu().double() - oracle(cell, step, seen, weight)).abs()
        worst = max(worst, err.nan_to_num(float("inf")).max().item())
    if fp8:
        checks["fp8 bytes"] = check_fp8_bytes(cache, cell, steps[-1])
    checks["rejects bad inputs"] = check_mla_bad_inputs(backend, cell, steps[-1], w)
    return worst


def check_fp8_bytes(cache: torch.Tensor, cell: MLACell, step: MLAStep) -> str:
    """Every slot the step wrote holds its latent quantized with saturation, bit for bit."""
    slots = step.common.slot_mappings[GROUP_ID].cpu()
    stored = cache.cpu()[slots // cell.block_size, slots % cell.block_size]
    want = quantize_fp8(step.latent.cpu(), torch.tensor(FP8_SCALE))
    if cache.dtype != want.dtype or not torch.equal(
        stored.view(torch.uint8), want.view(torch.uint8)
    ):
        return f"fail: the written slots do not hold e4m3(clamp(latent / {FP8_SCALE}, +-448))"
    return "pass"
