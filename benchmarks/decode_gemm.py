"""The decode-row GEMM (`kernels/layers/skinny_gemm.py`) against cuBLAS, same run, at
Llama-3-8B's projections (hidden 4096, q/k/v 6144, gate/up 2 x 14336, bf16).

    python benchmarks/decode_gemm.py [--rows 1,2,4,8,16,32,64] [--out DIR]

For each row count M, 32 layers of distinct random weights (14 GB: no layer's weights are in L2
when it starts) chained as a decoder layer without attention, captured in one CUDA graph and
replayed (CUDA events, median of 5 windows of 10 replays):
- `library`: the engine's path without the decode-row GEMM: `add_rms_norm`, cuBLAS q/k/v,
  cuBLAS o (on the first 4096 q/k/v columns, standing in for attention), `add_rms_norm`, cuBLAS
  gate/up, `act_and_mul`, cuBLAS down;
- `skinny`: the same kernels with the four GEMMs on `skinny_linear`.
The weights' bytes at the device-to-device copy bandwidth, measured after the layers (a warm
GPU), are the ideal; the two paths' final hidden states are compared (bf16: the GEMMs
accumulate in another order). Writes `DIR/decode_gemm.json` and `.png`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from common import (
    add_out_argument,
    capture_graph,
    csv_ints,
    graph_replay_ms,
    make_console,
    pyplot,
    run_header,
    save_figure,
    save_run,
    table,
)
from model_step_device import copy_bandwidth

from unified_attn.kernels.layers import skinny_gemm as sk
from unified_attn.kernels.layers.activation import act_and_mul
from unified_attn.kernels.layers.norm import add_rms_norm, rms_norm

SCHEMA = "unified_attn.benchmarks.decode_gemm/v1"
HIDDEN, QKV, INTER, LAYERS, EPS = 4096, 6144, 14336, 32, 1e-5
DEVICE, DTYPE = "cuda", torch.bfloat16  # the CPU smoke test runs small float32 layers
PATHS = ("library", "skinny")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=csv_ints, default=[1, 2, 4, 8, 16, 32, 64],
                        help=f"decode row counts, 1 to {sk.MAX_ROWS}, comma-separated")  # fmt: skip
    add_out_argument(parser)
    args = parser.parse_args(argv)
    if max(args.rows) > sk.MAX_ROWS:
        parser.error(f"--rows: at most {sk.MAX_ROWS} (the decode-row GEMM's limit), got "
                     f"{max(args.rows)}")  # fmt: skip
    return args


class Layer:
    """One layer's weights (DTYPE on DEVICE)."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator(device=DEVICE).manual_seed(seed)

        def randn(*shape: int) -> torch.Tensor:
            return (0.02 * torch.randn(*shape, generator=gen, device=DEVICE)).to(DTYPE)

        self.qkv, self.o = randn(QKV, HIDDEN), randn(HIDDEN, HIDDEN)
        self.gate_up, self.down = randn(2 * INTER, HIDDEN), randn(HIDDEN, INTER)
        self.norm1 = (1 + randn(HIDDEN)).contiguous()
        self.norm2 = (1 + randn(HIDDEN)).contiguous()

    @property
    def bytes(self) -> int:
        return 2 * (self.qkv.numel() + self.o.numel() + self.gate_up.numel() + self.down.numel())


def add_norm(h: torch.Tensor, res: torch.Tensor | None, weight: torch.Tensor) -> Any:
    """The layer's residual add and norm as the unfused kernels run them (no residual at first)."""
    if res is None:
        return rms_norm(h, weight, EPS, "llama"), h
    return add_rms_norm(h, res, weight, EPS, "llama")


def library_layer(layer: Layer, h: torch.Tensor, res: torch.Tensor | None) -> Any:
    return layer_with(torch.matmul, layer, h, res)


def skinny_layer(layer: Layer, h: torch.Tensor, res: torch.Tensor | None) -> Any:
    return layer_with(lambda x, w_t: sk.skinny_linear(x, w_t.t()), layer, h, res)


def layer_with(matmul: Callable[..., Any], layer: Layer, h: torch.Tensor,
               res: torch.Tensor | None) -> Any:  # fmt: skip
    """A pre-norm decoder layer without attention whose four GEMMs are `matmul(x, W^T)`."""
    x, res = add_norm(h, res, layer.norm1)
    o = matmul(matmul(x, layer.qkv.t())[:, :HIDDEN], layer.o.t())
    x, res = add_rms_norm(o, res, layer.norm2, EPS, "llama")
    gate_up = matmul(x, layer.gate_up.t())
    return matmul(act_and_mul(gate_up, "silu"), layer.down.t()), res


LAYER_FNS: dict[str, Callable[..., Any]] = {"library": library_layer, "skinny": skinny_layer}


def run_model(path: str, layers: list[Layer], x: torch.Tensor, out: torch.Tensor) -> None:
    h, res = x, None
    for layer in layers:
        h, res = LAYER_FNS[path](layer, h, res)
    out.copy_(h + res)


def measure_rows(rows: int, layers: list[Layer]) -> dict[str, Any]:
    x = (0.5 * torch.randn(rows, HIDDEN, device="cuda")).bfloat16()
    outs = {path: torch.empty_like(x) for path in PATHS}
    times = {}
    for path in PATHS:
        graph = capture_graph([lambda p=path: run_model(p, layers, x, outs[p])])
        times[path] = graph_replay_ms(graph)
    ref = outs["library"].float()
    diff = {p: ((outs[p].float() - ref).abs().max() / ref.abs().max()).item() for p in PATHS}
    return {"rows": rows, "ms": times,
            "library_over_skinny": times["library"] / times["skinny"],
            "max_rel_diff_vs_library": diff}  # fmt: skip


def report(results: dict[str, Any], console: Any) -> None:
    t = table("decode layers without attention, 32 layers, one CUDA graph (ms; H = ideal)",
              ["rows", "ideal", *PATHS, "library/skinny", "max rel diff"])  # fmt: skip
    for r in results["rows"]:
        t.add_row(str(r["rows"]), f"{r['ideal_ms']:.3f}",
                  *(f"{r['ms'][p]:.3f} ({r['fraction_of_ideal'][p]:.0%})" for p in PATHS),
                  f"{r['library_over_skinny']:.3f}",
                  f"{max(r['max_rel_diff_vs_library'].values()):.1e}")  # fmt: skip
    console.print(t)


def plot(results: dict[str, Any], path: Any, console: Any) -> None:
    plt = pyplot(console)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    rows = [r["rows"] for r in results["rows"]]
    for p in PATHS:
        ax.plot(rows, [r["fraction_of_ideal"][p] for r in results["rows"]], marker="o", label=p)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode rows")
    ax.set_ylabel("fraction of the weights' copy time")
    ax.set_title("Llama-3-8B layers without attention (H200, bf16)")
    ax.legend()
    save_figure(fig, path, 120)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/decode_gemm.py needs a CUDA GPU", file=sys.stderr)
        raise SystemExit(2)
    console = make_console(140)
    layers = [Layer(seed) for seed in range(LAYERS)]
    rows = [measure_rows(m, layers) for m in args.rows]
    # after the layers, on a warm GPU (measured first, cold, it read 2.7 TB/s)
    copy_bw = copy_bandwidth(torch.device("cuda"))
    for r in rows:
        r["ideal_ms"] = sum(layer.bytes for layer in layers) / copy_bw * 1e3
        r["fraction_of_ideal"] = {p: r["ideal_ms"] / t for p, t in r["ms"].items()}
    results = {**run_header(SCHEMA, "decode_gemm.py", False, argv),
               "copy_bandwidth_bytes_per_s": copy_bw, "rows": rows}  # fmt: skip
    save_run(args, "decode_gemm", results, plot, report, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
