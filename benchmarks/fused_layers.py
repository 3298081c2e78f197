"""The fused layers of a decoder step (`kernels/layers`, `models/fused.py`) against the torch code
they replace, same run, at Llama-3-8B's shapes (hidden 4096, intermediate 14336, 32 query and 8
KV heads of 128, bfloat16).

    python benchmarks/fused_layers.py [--tokens 1,64,256,8192] [--cases rms_norm,...] [--out DIR]
                                      [--quick]

Cases, each the model layer with its fused path on and off (the torch code is the model's CPU
path and the reference):
- `rms_norm`: a Llama RMSNorm over `[T, 4096]` (torch: pow, mean, rsqrt, casts, mul);
- `add_rms_norm`: the residual add and the norm (`RMSNorm.forward_residual`);
- `silu_and_mul`: `silu(gate) * up` from the `[T, 2 * 14336]` gate/up output;
- `rotary`: RoPE of q `[T, 32, 128]` and k `[T, 8, 128]` (llama3 scaling); fused: the kernel
  on the step's table (computed once per step for all layers), and `rotary+table` with it;
- `qkv_proj` / `gate_up_proj`: one GEMM of the packed weights (`PackedLinear`) against the
  separate projections;
- `layer`: a whole layer but its attention (norms, projections, RoPE, MLP, residual adds).
Per case and token count the median time replayed from a CUDA graph (as decode steps run;
`triton.testing.do_bench`), the eager time, `speedup` (torch / fused, same run), and for the
memory-bound kernels the bytes moved at the copy bandwidth measured in the run. Writes
`DIR/fused_layers.json` and `.png` (µs per call by token count, fused and torch).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
from common import (
    add_out_argument,
    capture_graph,
    command_line,
    gpu_ms,
    machine_info,
    make_console,
    output_dir,
    pyplot,
    save_figure,
    utc_timestamp,
    write_json,
)

from unified_attn.kernels.layers.activation import act_and_mul
from unified_attn.kernels.layers.rotary import apply_rotary
from unified_attn.models.config import ModelConfig, RopeScaling
from unified_attn.models.fused import PackedLinear
from unified_attn.models.layers import RMSNorm
from unified_attn.models.mlp import MLP
from unified_attn.models.rope import RotaryEmbedding

HIDDEN, INTER, HQ, HKV, HEAD = 4096, 14336, 32, 8, 128
QUICK = dict(hidden=256, inter=512, hq=4, hkv=2, head=64)
CASES = ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary", "rotary+table", "qkv_proj",
         "gate_up_proj", "layer")  # fmt: skip
DTYPE = torch.bfloat16
Fn = Callable[[], Any]


def llama_config(s: dict[str, int]) -> ModelConfig:
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)  # fmt: skip
    return ModelConfig(
        vocab_size=128256, hidden_size=s["hidden"], intermediate_size=s["inter"], num_layers=1,
        num_heads=s["hq"], num_kv_heads=s["hkv"], head_size=s["head"], rope_theta=500000.0,
        rope_scaling=scaling, max_position_embeddings=131072,
    )  # fmt: skip


class Modules:
    """One layer's modules but attention, random weights, on CUDA in bfloat16."""

    def __init__(self, s: dict[str, int]) -> None:
        config = llama_config(s)
        q, kv = s["hq"] * s["head"], s["hkv"] * s["head"]
        with torch.device("cuda"):
            self.norm = RMSNorm(s["hidden"], 1e-5).to(DTYPE)
            self.norm2 = RMSNorm(s["hidden"], 1e-5).to(DTYPE)
            self.projs = [torch.nn.Linear(s["hidden"], n, bias=False).to(DTYPE)
                          for n in (q, kv, kv)]  # fmt: skip
            self.o_proj = torch.nn.Linear(q, s["hidden"], bias=False).to(DTYPE)
            self.mlp = MLP(s["hidden"], s["inter"]).to(DTYPE)
            self.rotary = RotaryEmbedding(config).cuda()
        gen = torch.Generator(device="cuda").manual_seed(0)
        with torch.no_grad():
            for module in (*self.projs, self.o_proj, self.mlp, self.norm, self.norm2):
                for p in module.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen, device="cuda") * 0.02 + 0.01)
        self.packed = PackedLinear(self.projs)
        self.mlp.set_fused(True)  # packs gate_proj and up_proj (one packing per layer)
        assert self.mlp.packed is not None
        self.gate_up: PackedLinear = self.mlp.packed
        self.s = s

    def set_fused(self, enabled: bool) -> None:
        for module in (self.norm, self.norm2, self.mlp, self.rotary):
            module.set_fused(enabled)


def layer_fn(m: Modules, hidden: torch.Tensor, residual: torch.Tensor, pos: torch.Tensor) -> Fn:
    """A layer without attention (its output stands in as the attention's), as `DecoderLayer`
    runs it on the fused path or the torch one (whichever `m` is set to)."""
    s, t = m.s, hidden.shape[0]

    def run() -> torch.Tensor:
        with m.rotary.step(pos):
            normed, res = m.norm.forward_residual(hidden, residual)
            if m.norm.fused:
                q, k, _ = m.packed(normed).split(m.packed.sizes, dim=-1)
            else:
                q, k, _ = (proj(normed) for proj in m.projs)
            q, k = m.rotary(pos, q.view(t, s["hq"], s["head"]), k.view(t, s["hkv"], s["head"]))
            attn = m.o_proj(q.reshape(t, -1))
            normed, res = m.norm2.forward_residual(attn, res)
            return m.mlp(normed) + res

    return run


def inputs(m: Modules, t: int) -> dict[str, torch.Tensor]:
    s, gen = m.s, torch.Generator(device="cuda").manual_seed(t)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda").to(DTYPE)

    return {
        "x": rand(t, s["hidden"]),
        "residual": rand(t, s["hidden"]),
        "gate_up": rand(t, 2 * s["inter"]),
        "q": rand(t, s["hq"], s["head"]),
        "k": rand(t, s["hkv"], s["head"]),
        "positions": torch.arange(t, device="cuda"),
    }


def case_fn(name: str, m: Modules, a: dict[str, torch.Tensor], fused: bool) -> Fn:
    """The call of case `name` on inputs `a`, on the fused path or the torch one (`m` is
    already set to it)."""
    x, pos, q, k = a["x"], a["positions"], a["q"], a["k"]
    if name == "rms_norm":
        return functools.partial(m.norm, x)
    if name == "add_rms_norm":
        return functools.partial(m.norm.forward_residual, x, a["residual"])
    if name == "silu_and_mul":
        if fused:
            return functools.partial(act_and_mul, a["gate_up"], "silu")
        gate, up = a["gate_up"].chunk(2, dim=-1)
        return lambda: m.mlp._activate(gate) * up
    if name == "rotary" and fused:  # the step's table is computed once for all layers
        table = m.rotary.cos_sin_table(pos)
        return lambda: (apply_rotary(q, k, table), q)[1]
    if name.startswith("rotary"):
        return functools.partial(m.rotary, pos, q, k)
    if name in ("qkv_proj", "gate_up_proj"):
        packed = m.packed if name == "qkv_proj" else m.gate_up
        if fused:
            return lambda: packed(x).split(packed.sizes, dim=-1)
        return lambda: [linear(x) for linear in packed.linears]
    return layer_fn(m, x, a["residual"], pos)


def moved_bytes(name: str, s: dict[str, int], t: int) -> int:
    """Bytes the fused kernel reads and writes (0: a GEMM or the whole layer)."""
    hidden, heads = t * s["hidden"] * 2, t * (s["hq"] + s["hkv"]) * s["head"] * 2
    return {"rms_norm": 2 * hidden, "add_rms_norm": 4 * hidden,
            "silu_and_mul": 3 * t * s["inter"] * 2, "rotary": 2 * heads,
            "rotary+table": 2 * heads}.get(name, 0)  # fmt: skip


def graphed(fn: Fn) -> Fn:
    """`fn` captured in a CUDA graph (as a decode step runs it): its replay."""
    return capture_graph([fn]).replay


def first(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else first(out[0])


def measure(name: str, m: Modules, t: int, copy_tb_s: float) -> dict[str, Any]:
    """Both paths of case `name` over `t` tokens: ms in a graph and eager, the speedup, the
    largest difference of their first outputs, and the fused kernel's share of the copy
    bandwidth."""
    row: dict[str, Any] = {"tokens": t}
    outs = []
    for path, fused in (("fused", True), ("torch", False)):
        m.set_fused(fused)
        a = inputs(m, t)  # fresh inputs: rotary works in place
        fn = case_fn(name, m, a, fused)
        outs.append(first(fn()).float().clone())  # (rotary works in place)
        row[path] = {"ms": gpu_ms(graphed(fn)), "eager_ms": gpu_ms(fn)}
    row["speedup"] = row["torch"]["ms"] / row["fused"]["ms"]
    row["max_abs_diff"] = (outs[0] - outs[1]).abs().max().item()
    moved = moved_bytes(name, m.s, t)
    if moved:
        row["fused"]["tb_s"] = moved / row["fused"]["ms"] / 1e9
        row["fused"]["of_copy"] = row["fused"]["tb_s"] / copy_tb_s
    return row


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--tokens", default="1,64,256,8192", help="tokens per call")
    parser.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    parser.add_argument("--quick", action="store_true", help="small shapes, 1 and 64 tokens")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    args.cases = args.cases.split(",")
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        parser.error(f"--cases: unknown case {unknown[0]!r}; choose from {', '.join(CASES)}")
    try:
        args.tokens = [1, 64] if args.quick else [int(t) for t in args.tokens.split(",")]
        assert all(t > 0 for t in args.tokens)
    except (ValueError, AssertionError):
        parser.error(f"--tokens must be positive integers separated by commas, got {args.tokens!r}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    if not torch.cuda.is_available():
        print("benchmarks/fused_layers.py needs a CUDA GPU", file=sys.stderr)
        raise SystemExit(2)
    from v4_decode import copy_tb_s

    shape = QUICK if args.quick else dict(hidden=HIDDEN, inter=INTER, hq=HQ, hkv=HKV, head=HEAD)
    modules, copy = Modules(shape), copy_tb_s()
    result: dict[str, Any] = {"benchmark": "fused_layers",
                              "command": command_line("fused_layers.py", argv),
                              "timestamp": utc_timestamp(), "machine": machine_info(),
                              "shape": shape, "dtype": str(DTYPE), "copy_tb_s": copy,
                              "cases": {}}  # fmt: skip
    for name in args.cases:
        rows = result["cases"][name] = []
        for t in args.tokens:
            row = measure(name, modules, t, copy)
            rows.append(row)
            of_copy = row["fused"].get("of_copy")
            share = "" if of_copy is None else f", {100 * of_copy:.0f}% of copy"
            print(f"[fused_layers] {name} T={t}: fused {1e3 * row['fused']['ms']:.1f} us"
                  f"{share}, torch {1e3 * row['torch']['ms']:.1f} us ({row['speedup']:.2f}x), "
                  f"max diff {row['max_abs_diff']:.1e}", flush=True)  # fmt: skip
    write_json(output_dir(args) / "fused_layers.json", result)
    plot(result, output_dir(args))
    return result


def plot(result: dict[str, Any], out: Any) -> None:
    """One panel per case: µs per call against tokens, fused and torch (log-log)."""
    plt = pyplot(make_console(100))
    if plt is None:
        return
    cases = result["cases"]
    fig, axes = plt.subplots(1, len(cases), figsize=(4 * len(cases), 3.6), squeeze=False)
    for ax, (name, rows) in zip(axes[0], cases.items(), strict=True):
        for path in ("fused", "torch"):
            ax.plot([r["tokens"] for r in rows], [1e3 * r[path]["ms"] for r in rows],
                    marker="o", label=path)  # fmt: skip
        ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="µs per call", title=name)
        ax.legend()
    save_figure(fig, out / "fused_layers.png", 120)


if __name__ == "__main__":
    main()
