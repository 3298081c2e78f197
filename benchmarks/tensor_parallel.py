"""Tensor parallelism on CUDA: N ranks against one device, same model, same memory fraction.

    python benchmarks/tensor_parallel.py [--size 2] [--batch 64] [--quick]

For TP=1, then TP=N (each engine shut down and freed before the next): prompt logits of 4
prompts (bf16: the ranks sum partial projections in another order, so they differ within bf16
rounding), the KV cache each rank allocated at `--gpu-memory-utilization` (blocks per rank and
capacity in tokens), and decode throughput at batch `--batch`: the time of generating
`--max-tokens` tokens minus the time of generating 1 (the prefill), each after a warm-up run.
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
    make_console,
    output_dir,
    table,
    utc_timestamp,
    write_json,
)
from speculative import BENCH_MODEL, register_bench_model

from unified_attn import LLMEngine, SamplingParams
from unified_attn.harness.bench import machine_info

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


def measure(args: argparse.Namespace, size: int) -> dict[str, Any]:
    engine = LLMEngine(
        args.model,
        device=args.device,
        tensor_parallel_size=size,
        max_num_seqs=args.batch,
        max_model_len=2048,
        max_num_batched_tokens=8192,
        gpu_memory_utilization=args.gpu_memory_utilization,
        **args.memory,
    )
    try:
        vocab = engine.vocab_size
        probe = prompts(4, 96, vocab, seed=1)
        outs = engine.generate(probe, SamplingParams(max_tokens=1, prompt_logits=True))
        logits = [o.prompt_logits.float() for o in outs]
        batch = prompts(args.batch, args.prompt_len, vocab, seed=2)
        prefill_s = timed(engine, batch, 1)
        total_s = timed(engine, batch, args.max_tokens)
        decode_tokens = args.batch * (args.max_tokens - 1)
        report = engine.kv_cache_report
        return {
            "tensor_parallel_size": size,
            "rank_num_blocks": engine.rank_num_blocks,
            "num_blocks": report.num_blocks,
            "capacity_tokens": report.capacity_tokens,
            "bytes_per_block": report.bytes_per_block,
            "cuda_graphs": engine.runner.graphs is not None,
            "prefill_s": prefill_s,
            "decode_s": total_s - prefill_s,
            "decode_tokens_per_s": decode_tokens / (total_s - prefill_s),
            "_logits": logits,
        }
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


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
    logits = compare_logits(one.pop("_logits"), many.pop("_logits"))
    return {
        "benchmark": "tensor_parallel",
        "command": command_line("tensor_parallel.py", args.argv),
        "timestamp": utc_timestamp(),
        "machine": machine_info(),
        "model": args.model,
        "device": args.device,
        "params": {
            "batch": args.batch,
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "gpu_memory_utilization": args.gpu_memory_utilization,
        },
        "tp1": one,
        f"tp{args.size}": many,
        "prompt_logits": logits,
        "decode_speedup": many["decode_tokens_per_s"] / one["decode_tokens_per_s"],
        "capacity_ratio_per_gpu": many["capacity_tokens"] / one["capacity_tokens"],
    }


def print_table(report: dict[str, Any], size: int) -> None:
    out = table(
        f"tensor parallelism, {report['model']} on {report['device']}",
        ["ranks", "blocks per rank", "capacity (tokens)", f"decode tok/s (batch "
         f"{report['params']['batch']})"],
    )  # fmt: skip
    for key in ("tp1", f"tp{size}"):
        row = report[key]
        out.add_row(str(row["tensor_parallel_size"]), str(row["rank_num_blocks"]),
                    f"{row['capacity_tokens']:,}", f"{row['decode_tokens_per_s']:.0f}")  # fmt: skip
    console = make_console(110)
    console.print(out)
    lg = report["prompt_logits"]
    console.print(
        f"decode {report['decode_speedup']:.2f}x, capacity per GPU "
        f"{report['capacity_ratio_per_gpu']:.2f}x; prompt logits max |diff| "
        f"{lg['max_abs_diff']:.3g} (mean {lg['mean_abs_diff']:.3g}, logits up to "
        f"{lg['max_abs_logit']:.3g}), argmax agreement {lg['argmax_agreement']:.1%}"
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny-llama on CPU, short runs")
    parser.add_argument("--size", type=int, default=2, help="tensor_parallel_size to compare")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    add_out_argument(parser)
    args = parser.parse_args(argv)
    args.argv = argv
    args.model, args.device, args.memory = BENCH_MODEL, "cuda", {"kv_cache_memory": None}
    if args.quick:
        args.model, args.device, args.memory = "tiny-llama", "cpu", {"kv_cache_memory": "16MiB"}
        args.batch, args.max_tokens, args.prompt_len = min(args.batch, 4), 8, 32
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    report = run(args)
    write_json(output_dir(args) / "tensor_parallel.json", report)
    print_table(report, args.size)
    return report


if __name__ == "__main__":
    main()
