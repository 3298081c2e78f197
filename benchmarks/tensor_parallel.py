"""Tensor parallelism on CUDA: N ranks against one device, same model, same memory fraction.

    python benchmarks/tensor_parallel.py [--size 2] [--batch 64 256] [--quick]

For TP=1, then TP=N (each engine shut down and freed before the next): prompt logits of 4
prompts, the KV cache each rank allocated at `--gpu-memory-utilization` (blocks per rank and
capacity in tokens), and decode throughput at each batch of `--batch`: the time of generating
`--max-tokens` tokens minus the time of generating 1 (the prefill), each after a warm-up run.
The logits' tolerance is bf16's own: the ranks sum partial projections in another order, so
both bf16 runs are compared with a float32 run of one device, and TP=N should be as far from it
as TP=1 is.
Model: `bench-llama-1b` (1.2B random Llama, see speculative.py), bf16, Triton, CUDA graphs;
`tiny-llama` on CPU with `--quick`. Writes `<out>/tensor_parallel.json`.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from collections.abc import Sequence
from typing import Any

import torch
from common import (
    add_out_argument,
    command_line,
    machine_info,
    make_console,
    output_dir,
    table,
    utc_timestamp,
    write_json,
)
from speculative import BENCH_MODEL, register_bench_model

from unified_attn import LLMEngine, SamplingParams

# At import: the spawned ranks import this module again (multiprocessing's spawn) and must know
# the preset too.
register_bench_model()


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(count)]


def timed(engine: LLMEngine, batch: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine.generate(batch, params)  # warm-up: the same shapes (the prompts then hit the cache)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate(batch, params)
    return time.perf_counter() - start


def make_engine(args: argparse.Namespace, size: int, **options: Any) -> LLMEngine:
    gc.collect()  # the previous engine's cache and graphs
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return LLMEngine(
        args.model,
        device=args.device,
        tensor_parallel_size=size,
        max_num_seqs=max(args.batch),
        max_model_len=2048,
        max_num_batched_tokens=8192,
        gpu_memory_utilization=args.gpu_memory_utilization,
        **args.memory,
        **options,
    )


def prompt_logits(engine: LLMEngine) -> list[torch.Tensor]:
    probe = prompts(4, 96, engine.vocab_size, seed=1)
    outs = engine.generate(probe, SamplingParams(max_tokens=1, prompt_logits=True))
    return [o.prompt_logits.float() for o in outs]


def decode_speed(engine: LLMEngine, args: argparse.Namespace, batch_size: int) -> dict[str, Any]:
    batch = prompts(batch_size, args.prompt_len, engine.vocab_size, seed=2)
    prefill_s = timed(engine, batch, 1)
    total_s = timed(engine, batch, args.max_tokens)
    decode_tokens = batch_size * (args.max_tokens - 1)
    return {
        "batch": batch_size,
        "prefill_s": prefill_s,
        "decode_s": total_s - prefill_s,
        "decode_tokens_per_s": decode_tokens / (total_s - prefill_s),
    }


def measure(args: argparse.Namespace, size: int) -> dict[str, Any]:
    engine = make_engine(args, size)
    try:
        logits = prompt_logits(engine)
        decode = [decode_speed(engine, args, b) for b in args.batch]
        report = engine.kv_cache_report
        return {
            "tensor_parallel_size": size,
            "rank_num_blocks": engine.rank_num_blocks,
            "num_blocks": report.num_blocks,
            "capacity_tokens": report.capacity_tokens,
            "bytes_per_block": report.bytes_per_block,
            "cuda_graphs": engine.runner.graphs is not None,
            "decode": decode,
            "_logits": logits,
        }
    finally:
        release(engine)


def float32_logits(args: argparse.Namespace) -> list[torch.Tensor]:
    """The float32 logits of one device: the yardstick of bf16 rounding."""
    engine = make_engine(args, 1, dtype="float32")
    try:
        return prompt_logits(engine)
    finally:
        release(engine)


def release(engine: LLMEngine) -> None:
    engine.shutdown()  # stops the other ranks; `make_engine` frees this one's memory


def compare_logits(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict[str, float]:
    diffs = [(x - y).abs() for x, y in zip(a, b, strict=True)]
    scale = max(float(x.abs().max()) for x in a)
    argmax = sum(int((x.argmax(-1) == y.argmax(-1)).sum()) for x, y in zip(a, b, strict=True))
    rows = sum(x.shape[0] for x in a)
    return {
        "max_abs_diff": max(float(d.max()) for d in diffs),
        "mean_abs_diff": sum(float(d.mean()) for d in diffs) / len(diffs),
        "max_abs_logit": scale,
        "argmax_agreement": argmax / rows,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    one = measure(args, 1)
    many = measure(args, args.size)
    a, b = one.pop("_logits"), many.pop("_logits")
    exact = float32_logits(args)
    return {
        "benchmark": "tensor_parallel",
        "command": command_line("tensor_parallel.py", args.argv),
        "timestamp": utc_timestamp(),
        "machine": machine_info(),
        "model": args.model,
        "device": args.device,
        "params": {
            "batches": args.batch,
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "gpu_memory_utilization": args.gpu_memory_utilization,
        },
        "tp1": one,
        f"tp{args.size}": many,
        "prompt_logits": compare_logits(a, b),
        "prompt_logits_vs_float32": {
            "tp1": compare_logits(exact, a),
            f"tp{args.size}": compare_logits(exact, b),
        },
        "decode_speedup": {
            str(x["batch"]): y["decode_tokens_per_s"] / x["decode_tokens_per_s"]
            for x, y in zip(one["decode"], many["decode"], strict=True)
        },
        "capacity_ratio_per_gpu": many["capacity_tokens"] / one["capacity_tokens"],
    }


def print_table(report: dict[str, Any], size: int) -> None:
    batches = report["params"]["batches"]
    out = table(
        f"tensor parallelism, {report['model']} on {report['device']}",
        ["ranks", "blocks per rank", "capacity (tokens)",
         *[f"decode tok/s (batch {b})" for b in batches]],
    )  # fmt: skip
    for key in ("tp1", f"tp{size}"):
        row = report[key]
        out.add_row(str(row["tensor_parallel_size"]), str(row["rank_num_blocks"]),
                    f"{row['capacity_tokens']:,}",
                    *[f"{d['decode_tokens_per_s']:.0f}" for d in row["decode"]])  # fmt: skip
    console = make_console(110)
    console.print(out)
    speedups = ", ".join(f"{v:.2f}x at batch {k}" for k, v in report["decode_speedup"].items())
    lg, fp = report["prompt_logits"], report["prompt_logits_vs_float32"]
    console.print(
        f"decode {speedups}; capacity per GPU {report['capacity_ratio_per_gpu']:.2f}x; prompt "
        f"logits TP{size} vs TP1 max |diff| {lg['max_abs_diff']:.3g} (logits up to "
        f"{lg['max_abs_logit']:.3g}, argmax agreement {lg['argmax_agreement']:.1%}); against "
        f"float32: TP1 {fp['tp1']['max_abs_diff']:.3g} (mean {fp['tp1']['mean_abs_diff']:.3g}), "
        f"TP{size} {fp[f'tp{size}']['max_abs_diff']:.3g} "
        f"(mean {fp[f'tp{size}']['mean_abs_diff']:.3g})"
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny-llama on CPU, short runs")
    parser.add_argument("--size", type=int, default=2, help="tensor_parallel_size to compare")
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    add_out_argument(parser)
    args = parser.parse_args(argv)
    args.argv = argv
    args.model, args.device, args.memory = BENCH_MODEL, "cuda", {"kv_cache_memory": None}
    if args.quick:
        args.model, args.device, args.memory = "tiny-llama", "cpu", {"kv_cache_memory": "16MiB"}
        args.batch, args.max_tokens, args.prompt_len = [min(b, 4) for b in args.batch], 8, 32
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    report = run(args)
    write_json(output_dir(args) / "tensor_parallel.json", report)
    print_table(report, args.size)
    return report


if __name__ == "__main__":
    main()
