"""MLA decode projections: the weight-absorbed path's two products around the latent attention
(q_nope @ W_UK into the latent space, the latent output @ W_UV back), at DeepSeek-V3 shapes, as
the MLA backends run them (`absorb_query` and the W_UV product in `backends/mla.py`: in the
model dtype) against the float32 formulation they used before 2026-11-23 (each weight converted
to float32 on every call, then the products in float32), measured in the same run.

    python benchmarks/mla_projections.py [--out DIR] [--quick]

Each variant runs in a CUDA graph over 4 sets of distinct inputs (the weights are shared, as
one layer's are). Reports µs per call (both products), the ratio, and the largest difference of
the absorbed queries and of the outputs between the two, relative to their largest magnitude.
JSON and a bar chart (PNG) in `results/mla_projections.json` / `.png` (`--out` elsewhere).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from attn_bench.timing import time_calls
from common import (
    add_out_argument,
    command_line,
    machine_info,
    output_dir,
    pyplot,
    save_figure,
    utc_timestamp,
    write_json,
)
from rich.console import Console

from unified_attn.backends.mla_math import absorb_query, project_latent_out

NOPE, LATENT, ROPE, V_HEAD = 128, 512, 64, 128  # DeepSeek-V3
SHAPES = [(128, 64), (128, 128), (16, 64), (16, 128), (128, 1)]  # (heads, decode tokens)
QUICK_SHAPES = [(16, 8)]
ROTATIONS = 4


def as_before(q: torch.Tensor, w_uk: torch.Tensor, latent: torch.Tensor, w_uv: torch.Tensor):
    """The float32 formulation: weights converted on every call."""
    q_lat = torch.einsum("thn,hnl->thl", q[..., :NOPE].float(), w_uk.float())
    q_abs = torch.cat([q_lat.to(q.dtype), q[..., NOPE:]], dim=-1)
    out = torch.einsum("thl,hlv->thv", latent.float(), w_uv.float()).to(q.dtype)
    return q_abs, out


def as_now(q: torch.Tensor, w_uk: torch.Tensor, latent: torch.Tensor, w_uv: torch.Tensor):
    """The backends' formulation: both products as batched GEMMs in the model dtype, written
    into their outputs."""
    out = latent.new_empty(*latent.shape[:2], w_uv.shape[2])
    project_latent_out(latent, w_uv, out)
    return absorb_query(q, w_uk), out


def measure(heads: int, tokens: int, dtype: torch.dtype) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(heads * 1000 + tokens)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)

    w_uk, w_uv = rand(heads, NOPE, LATENT, scale=0.05), rand(heads, LATENT, V_HEAD, scale=0.05)
    inputs = [(rand(tokens, heads, NOPE + ROPE), rand(tokens, heads, LATENT))
              for _ in range(ROTATIONS)]  # fmt: skip
    row: dict[str, Any] = {"heads": heads, "tokens": tokens}
    for name, fn in (("float32_weights_us", as_before), ("model_dtype_us", as_now)):
        calls: list[Callable[[], Any]] = [
            (lambda q=q, lat=lat, fn=fn: fn(q, w_uk, lat, w_uv)) for q, lat in inputs
        ]
        ms, how = time_calls(calls, graph=True)
        if not how.startswith("cuda_graph"):
            raise RuntimeError(f"mla_projections: timing fell back to {how}")
        row[name] = ms * 1e3
    q, lat = inputs[0]
    before, now = as_before(q, w_uk, lat, w_uv), as_now(q, w_uk, lat, w_uv)
    for what, a, b in (("q_abs", before[0], now[0]), ("out", before[1], now[1])):
        a, b = a.float(), b.float()
        row[f"{what}_rel_diff"] = ((a - b).abs().max() / a.abs().max()).item()
    row["speedup"] = row["float32_weights_us"] / row["model_dtype_us"]
    return row


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    add_out_argument(parser)
    parser.add_argument("--quick", action="store_true", help="one small shape")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/mla_projections.py needs a CUDA GPU", file=sys.stderr)
        raise SystemExit(2)
    rows = [measure(h, t, torch.bfloat16) for h, t in (QUICK_SHAPES if args.quick else SHAPES)]
    for r in rows:
        print(f"[mla_projections] H {r['heads']:3d} T {r['tokens']:3d}: float32 weights "
              f"{r['float32_weights_us']:7.1f} us, model dtype {r['model_dtype_us']:6.1f} us "
              f"({r['speedup']:.1f}x); rel diff q_abs {r['q_abs_rel_diff']:.1e}, out "
              f"{r['out_rel_diff']:.1e}", flush=True)  # fmt: skip
    result = {"benchmark": "mla_projections", "command": command_line("mla_projections.py", argv),
              "timestamp": utc_timestamp(), "machine": machine_info(), "dtype": "bfloat16",
              "rows": rows}  # fmt: skip
    write_json(output_dir(args) / "mla_projections.json", result)
    plot(result, output_dir(args) / "mla_projections.png")
    return result


def plot(result: dict[str, Any], path: Any) -> None:
    """Bars of µs per call, both formulations, one group per (heads, tokens) shape."""
    plt = pyplot(Console())
    if plt is None:
        return
    rows = result["rows"]
    labels = [f"H {r['heads']}\nT {r['tokens']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar([i - 0.2 for i in x], [r["float32_weights_us"] for r in rows], 0.4,
           label="float32 weights per call (before)")  # fmt: skip
    ax.bar([i + 0.2 for i in x], [r["model_dtype_us"] for r in rows], 0.4,
           label="batched GEMMs, model dtype (now)")  # fmt: skip
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("µs per call (both products)")
    ax.set_title(f"MLA decode projections, {result['dtype']}, {result['machine'].get('gpu', '')}")
    ax.legend()
    save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    main()
