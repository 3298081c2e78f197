"""Routed experts of one MoE layer: the grouped kernels (`kernels/moe/grouped_experts.py`) against
torch's grouped GEMM (`torch.nn.functional.grouped_mm`) and the dense form (every expert on
every token, `RoutedExperts.reference`), same run, with the hardware ceilings measured in it.

    python benchmarks/moe_experts.py [--shapes deepseek-v3,qwen3-30b-a3b] [--tokens 1,8,64,512,4096]
                                     [--dense-max 512] [--out DIR] [--quick]

Shapes (experts, chosen per token, hidden size, expert width): DeepSeek-V3 (256, 8, 7168,
2048; 22.5 GB of bf16 weights in the layer), Qwen3-30B-A3B (128, 8, 2048, 768), the small MoE
of benchmarks/v4_engine_decode.py's model (8, 2, 1024, 256), all SwiGLU experts with gate and
up as row blocks, and GPT-OSS-20B (32, 4, 2880, 2880: gate and up interleaved, biases, its
clamped activation). Each token
chooses k distinct experts uniformly at random, with random routing weights. Per case, the
median time of each implementation replayed from a CUDA graph (`triton.testing.do_bench`; a
decode step runs them so; the eager time is recorded too), and for the grouped kernels:
- the bytes of the experts the tokens chose (each chosen expert's three matrices, once) at the
  copy bandwidth: the floor while few tokens share an expert (decode);
- the routed FLOPs (`2 * T * k * 3 * D * I`) against the bf16 matmul ceiling: the floor when
  many do (prefill).
The peer sorts the pairs by expert (argsort, gather), runs two `grouped_mm` with the activation
(and GPT-OSS's biases) between them, weights the rows and adds them back per token
(`index_add_`). The dense form runs
up to `--dense-max` tokens. Outputs are checked against a float32 sum over each sampled
token's chosen experts. Writes `DIR/moe_experts.json` and `.png` (µs per call by token count).
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

import attrs
import torch
from common import (
    add_out_argument,
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

from unified_attn.kernels.moe.grouped_experts import GroupedConfig, default_config, grouped_experts
from unified_attn.models.config import MoEConfig
from unified_attn.models.moe import Experts, RoutedExperts, swiglu

SHAPES = {
    "deepseek-v3": (256, 8, 7168, 2048),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "v4-engine-bench": (8, 2, 1024, 256),
    "gpt-oss-20b": (32, 4, 2880, 2880),  # GPT-OSS's experts: interleaved, biases, clamped
    "bench-moe-1b": (8, 2, 2048, 1024),  # GPT-OSS's layout (batch_invariance.py's model)
}
GPT_OSS_LAYOUT = ("gpt-oss-20b", "bench-moe-1b", "tiny-gpt-oss")
QUICK_SHAPE = {"tiny": (16, 4, 256, 128), "tiny-gpt-oss": (8, 2, 256, 128)}


def make_experts(name: str, shape: tuple[int, int, int, int]) -> RoutedExperts | Experts:
    num, _, hidden, inter = shape
    experts: RoutedExperts | Experts = (
        Experts(hidden, inter, MoEConfig(num_experts=num, top_k=shape[1]))
        if name in GPT_OSS_LAYOUT else RoutedExperts(num, hidden, inter, None)
    )  # fmt: skip
    experts = experts.to("cuda", torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(0.0, param.shape[-1] ** -0.5, generator=gen)
    return experts


def make_routing(shape: tuple[int, int, int, int], tokens: int) -> tuple[torch.Tensor, ...]:
    """x `[T, D]` bf16, routing weights `[T, k]` float32 and k distinct expert ids per token."""
    num, k, hidden, _ = shape
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
    ids = torch.rand(tokens, num, device="cuda", generator=gen).argsort(dim=1)[:, :k]
    weights = torch.rand(tokens, k, device="cuda", generator=gen).softmax(dim=1)
    return x, weights, ids


def grouped_mm_peer(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    experts: RoutedExperts | Experts) -> torch.Tensor:  # fmt: skip
    """torch's grouped GEMM over the pairs sorted by expert."""
    grouped_mm = torch.nn.functional.grouped_mm
    num, k = experts.gate_up_proj.shape[0], ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat)
    counts = torch.zeros(num, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    rows = x[order // k]
    if isinstance(experts, Experts):  # GPT-OSS: [E, H, 2I] interleaved, biases
        owner = flat[order]
        both = grouped_mm(rows, experts.gate_up_proj, offs=offs) + experts.gate_up_proj_bias[owner]
        gate = both[:, ::2].clamp(max=experts.limit)
        up = both[:, 1::2].clamp(min=-experts.limit, max=experts.limit)
        hidden = (up + 1) * gate * torch.sigmoid(gate * experts.alpha)
        out = grouped_mm(hidden, experts.down_proj, offs=offs) + experts.down_proj_bias[owner]
    else:
        gate, up = grouped_mm(rows, experts.gate_up_proj.transpose(1, 2), offs=offs).chunk(2, -1)
        out = grouped_mm(swiglu(gate, up), experts.down_proj.transpose(1, 2), offs=offs)
    out = out.float() * weights.reshape(-1)[order, None]
    total = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    return total.index_add_(0, order // k, out).to(x.dtype)


def graphed(fn: Any) -> Any:
    """`fn` captured in a CUDA graph (as a decode step runs it): its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def exact(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
          experts: RoutedExperts | Experts, sample: list[int]) -> torch.Tensor:  # fmt: skip
    """The `sample` tokens' sums over their chosen experts, by the dense reference in float32 on
    a copy of those experts alone."""
    chosen = torch.unique(ids[sample])
    down = experts.down_proj
    small: RoutedExperts | Experts = (
        Experts(down.shape[2], down.shape[1], MoEConfig(
            num_experts=len(chosen), top_k=1, swiglu_alpha=experts.alpha,
            swiglu_limit=experts.limit))
        if isinstance(experts, Experts)
        else RoutedExperts(len(chosen), down.shape[1], down.shape[2], experts.limit)
    )  # fmt: skip
    small = small.cuda()
    with torch.no_grad():
        for name, param in small.named_parameters():
            param.copy_(getattr(experts, name)[chosen].float())
        local = torch.searchsorted(chosen, ids[sample])
        return small.reference(x[sample].float(), weights[sample], local)


def measure_case(
    shape: tuple[int, ...],
    tokens: int,
    experts: RoutedExperts | Experts,
    dense_max: int,
    ceilings: dict[str, float],
    configs: list[GroupedConfig],
) -> dict[str, Any]:
    num, k, hidden, inter = shape
    x, weights, ids = make_routing(shape, tokens)  # type: ignore[arg-type]
    stacked, act = experts.kernel_weights()
    impls = {"grouped": functools.partial(grouped_experts, x, weights, ids, stacked, act)}
    for cfg in configs:
        impls[f"grouped {'/'.join(map(str, attrs.astuple(cfg)))}"] = functools.partial(
            grouped_experts, x, weights, ids, stacked, act, cfg
        )
    if hasattr(torch.nn.functional, "grouped_mm"):
        impls["torch_grouped_mm"] = functools.partial(grouped_mm_peer, x, weights, ids, experts)
    if tokens <= dense_max:
        impls["dense"] = functools.partial(experts.reference, x, weights, ids)
    sample = sorted({0, tokens // 2, tokens - 1})
    want = exact(x, weights, ids, experts, sample)
    active = int(torch.unique(ids).numel())
    default = default_config(tokens * k, num)
    row: dict[str, Any] = {"tokens": tokens, "active_experts": active,
                           "grouped_config": attrs.asdict(default),
                           "weight_bytes": active * 3 * hidden * inter * 2,
                           "flops": 2 * tokens * k * 3 * hidden * inter}  # fmt: skip
    for name, fn in impls.items():
        try:
            got = fn()
        except RuntimeError as error:  # a peer that does not take this layout: recorded
            if name == "grouped":
                raise
            row[f"{name}_error"] = str(error).splitlines()[0]
            continue
        err = ((got[sample].float() - want).abs().max() / want.abs().max()).item()
        row[name] = {"ms": gpu_ms(graphed(fn)), "eager_ms": gpu_ms(fn), "rel_err": err}
    ms = row["grouped"]["ms"]
    row["tb_s"] = row["weight_bytes"] / ms / 1e9
    row["over_copy_time"] = ms / (row["weight_bytes"] / ceilings["copy_tb_s"] / 1e9)
    row["tflops"] = row["flops"] / ms / 1e9
    row["of_matmul"] = row["tflops"] / ceilings["matmul_tflops"]
    for peer in ("torch_grouped_mm", "dense"):
        if peer in row:
            row[peer]["speedup"] = row[peer]["ms"] / ms
    return row


def ceilings() -> dict[str, float]:
    """Device-to-device copy TB/s and bf16 matmul TFLOP/s (8192 cubed), measured now."""
    from v4_decode import copy_tb_s

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    matmul = 2 * 8192**3 / gpu_ms(functools.partial(torch.matmul, a, a)) / 1e9
    return {"copy_tb_s": copy_tb_s(), "matmul_tflops": matmul}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--tokens", default="1,8,64,512,4096", help="tokens per call")
    parser.add_argument("--dense-max", type=int, default=512, help="most tokens for the dense form")
    parser.add_argument(
        "--configs",
        default="",
        help="also time the grouped kernels with these "
        "tiles: BLOCK_M/BLOCK_N/BLOCK_K/WARPS/STAGES,...",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny shape, 1 and 64 tokens")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    shapes = QUICK_SHAPE if args.quick else {}
    for name in [] if args.quick else args.shapes.split(","):
        if name not in SHAPES:
            parser.error(f"--shapes: unknown shape {name!r}; choose from {', '.join(SHAPES)}")
        shapes[name] = SHAPES[name]
    try:
        counts = [1, 64] if args.quick else [int(t) for t in args.tokens.split(",")]
        assert all(t > 0 for t in counts)
    except (ValueError, AssertionError):
        parser.error(f"--tokens must be positive integers separated by commas, got {args.tokens!r}")
    try:
        configs = [GroupedConfig(*map(int, c.split("/"))) for c in args.configs.split(",") if c]
    except TypeError:
        parser.error(f"--configs: each must be BLOCK_M/BLOCK_N/BLOCK_K/WARPS/STAGES, got "
                     f"{args.configs!r}")  # fmt: skip
    except ValueError:
        parser.error(f"--configs: integers only, got {args.configs!r}")
    if not torch.cuda.is_available():
        print("benchmarks/moe_experts.py needs a CUDA GPU", file=sys.stderr)
        raise SystemExit(2)
    limits = ceilings()
    result: dict[str, Any] = {"benchmark": "moe_experts",
                              "command": command_line("moe_experts.py", argv),
                              "timestamp": utc_timestamp(), "machine": machine_info(),
                              **limits, "shapes": {}}  # fmt: skip
    for name, shape in shapes.items():
        experts = make_experts(name, shape)
        fields = dict(zip(("experts", "k", "hidden", "inter"), shape, strict=True))
        rows = result["shapes"][name] = {"shape": fields, "cases": []}
        for tokens in counts:
            row = measure_case(shape, tokens, experts, args.dense_max, limits, configs)
            rows["cases"].append(row)
            peers = ", ".join(f"{p} {1e3 * row[p]['ms']:.1f} us ({row[p]['speedup']:.2f}x)"
                              for p in ("torch_grouped_mm", "dense") if p in row)  # fmt: skip
            print(f"[moe_experts] {name} T={tokens}: grouped {1e3 * row['grouped']['ms']:.1f} us "
                  f"({row['active_experts']} experts, {row['tb_s']:.2f} TB/s = "
                  f"{row['over_copy_time']:.2f}x copy time; {row['tflops']:.0f} TFLOP/s = "
                  f"{100 * row['of_matmul']:.0f}% of matmul); {peers}; err "
                  f"{row['grouped']['rel_err']:.1e}", flush=True)  # fmt: skip
        del experts
        torch.cuda.empty_cache()
    write_json(output_dir(args) / "moe_experts.json", result)
    plot(result, output_dir(args))
    return result


def plot(result: dict[str, Any], out: Any) -> None:
    """One panel per shape: µs per call against tokens, per implementation (log-log)."""
    plt = pyplot(make_console(100))
    if plt is None:
        return
    shapes = result["shapes"]
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, (name, rows) in zip(axes[0], shapes.items(), strict=True):
        for impl in ("grouped", "torch_grouped_mm", "dense"):
            points = [(r["tokens"], 1e3 * r[impl]["ms"]) for r in rows["cases"] if impl in r]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=impl)
        ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="µs per call", title=name)
        ax.legend()
    save_figure(fig, out / "moe_experts.png", 120)


if __name__ == "__main__":
    main()
