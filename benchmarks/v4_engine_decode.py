"""DeepSeek-V4 decode steps in the engine: replayed CUDA graphs against eager steps, same run.

    python benchmarks/v4_engine_decode.py [--out DIR] [--batches 8,64] [--context 2048]
                                          [--steps 32] [--max-model-len N] [--quick]

The model is random, with V4's attention shape and a small rest: 4 layers (sliding, CSA, HCA,
CSA), 64 heads of 512 (64 RoPE features), window 128, compression rates 4 and 128, a lightning
indexer of 64 heads x 128 keeping the top 512 entries, learned sinks, hyper-connections, and a
hidden size of 1024 with 8 routed experts of 256 (so attention, not the MoE, dominates the
step). bf16 on `triton-deepseek-v4`. For each batch size, one engine per mode (`cuda_graphs`
False, then True) runs `batch` requests of `context` random tokens to the end of their prefill,
then `steps` decode steps; each step is timed on the host (`LLMEngine.step()`, which returns
after the sampled tokens reach the host). Reported: the median decode step, tokens per second,
and graphs' speedup over eager steps. A graph step reads `max_model_len // rate` compressed
entries per request (the kernels stop at each token's own): `--max-model-len 65536` shows what
that costs. Writes `DIR/v4_engine_decode.json` and `.png`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import attrs
import torch
from common import (
    add_out_argument,
    command_line,
    machine_info,
    make_console,
    output_dir,
    pyplot,
    save_figure,
    table,
    utc_timestamp,
    write_json,
)

from unified_attn import LLMEngine, SamplingParams
from unified_attn.models import V4_PRESETS
from unified_attn.sampling_params import RequestOutputKind

SHAPE = "deepseek-v4-decode-shape"  # the preset this script registers (in this process only)
SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)


def register_shape() -> None:
    """V4's attention shape on a small random model, as a preset the engine can load."""
    V4_PRESETS[SHAPE] = attrs.evolve(
        V4_PRESETS["deepseek-v4-like"], name=SHAPE, vocab_size=4096, hidden_size=1024,
        moe_intermediate_size=256, num_layers=4, num_heads=64, head_dim=512,
        qk_rope_head_dim=64, q_lora_rank=256, o_groups=8, o_lora_rank=128, sliding_window=128,
        layer_types=(SLIDING, CSA, HCA, CSA), mlp_layer_types=("hash_moe", "moe", "moe", "moe"),
        csa_compress_rate=4, hca_compress_rate=128, index_n_heads=64, index_head_dim=128,
        index_topk=512, n_routed_experts=8, num_experts_per_tok=2,
        max_position_embeddings=65536, rope_scaling=None, compress_rope_scaling=None,
    )  # fmt: skip


def decode_steps(batch: int, context: int, steps: int, graphs: bool,
                 max_model_len: int = 0) -> dict[str, Any]:  # fmt: skip
    """Host ms of each decode step of `batch` requests after `context`-token prompts
    (`max_model_len` 0: the context, the steps and a margin)."""
    engine = LLMEngine(SHAPE, backend="triton-deepseek-v4", device="cuda", dtype="bfloat16",
                       cuda_graphs=graphs, max_num_seqs=batch,
                       max_model_len=max_model_len or context + steps + 64,
                       kv_cache_memory="8GiB",
                       max_num_batched_tokens=max(context, 8192))  # fmt: skip
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(
        max_tokens=steps + 1, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    for _ in range(batch):
        engine.add_request(None, torch.randint(3, 4000, (context,), generator=gen).tolist(), params)
    times = []
    while engine.has_unfinished_requests():
        prefill = engine.stats.prefill_tokens
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        if engine.stats.prefill_tokens == prefill:  # a decode step
            times.append(1e3 * (time.perf_counter() - start))
    replays = engine.runner.graphs.num_replays if engine.runner.graphs is not None else 0
    del engine
    torch.cuda.empty_cache()
    timed = times[2:]  # the first decode steps also warm the allocator and kernels up
    median = statistics.median(timed)
    return {"graphs": graphs, "decode_steps": len(times), "graph_replays": replays,
            "step_ms": timed, "median_step_ms": median,
            "tokens_per_s": batch / median * 1e3}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--batches", default="8,64", help="decode batch sizes, comma-separated")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=0,
                        help="the engines' max_model_len (0: context + steps + 64)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="batch 4, 256-token prompts")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
        too_short = 0 < args.max_model_len < args.context + args.steps + 1
        if min(batches) < 1 or args.context < 1 or args.steps < 4 or too_short:
            raise ValueError
    except ValueError:
        print(f"--batches takes positive ints (e.g. 8,64), --context >= 1, --steps >= 4 and "
              f"--max-model-len 0 or above context + steps; got {args.batches!r}, "
              f"{args.context}, {args.steps}, {args.max_model_len}", file=sys.stderr)  # fmt: skip
        raise SystemExit(2) from None
    if args.quick:
        batches, args.context, args.steps = [4], 256, 8
    if not torch.cuda.is_available():
        print("benchmarks/v4_engine_decode.py needs a CUDA GPU", file=sys.stderr)
        raise SystemExit(2)
    register_shape()
    result: dict[str, Any] = {"benchmark": "v4_engine_decode",
                              "command": command_line("v4_engine_decode.py", argv),
                              "timestamp": utc_timestamp(), "machine": machine_info(),
                              "model": attrs.asdict(V4_PRESETS[SHAPE]), "context": args.context,
                              "steps": args.steps, "max_model_len": args.max_model_len,
                              "runs": []}  # fmt: skip
    console = make_console(100)
    columns = ["batch", "eager ms/step", "graphs ms/step", "speedup", "graphs tokens/s"]
    report = table(f"V4 decode steps, {args.context}-token prompts", columns)
    for batch in batches:
        eager = decode_steps(batch, args.context, args.steps, False, args.max_model_len)
        graphs = decode_steps(batch, args.context, args.steps, True, args.max_model_len)
        if graphs["graph_replays"] == 0:
            raise RuntimeError("v4_engine_decode: the engine replayed no CUDA graph")
        speedup = eager["median_step_ms"] / graphs["median_step_ms"]
        result["runs"].append({"batch": batch, "eager": eager, "graphs": graphs,
                               "speedup": speedup})  # fmt: skip
        report.add_row(str(batch), f"{eager['median_step_ms']:.2f}",
                       f"{graphs['median_step_ms']:.2f}", f"{speedup:.1f}x",
                       f"{graphs['tokens_per_s']:.0f}")  # fmt: skip
    console.print(report)
    out = output_dir(args)
    write_json(out / "v4_engine_decode.json", result)
    plot(result, out, console)
    return result


def plot(result: dict[str, Any], out: Any, console: Any) -> None:
    plt = pyplot(console)
    if plt is None:
        return
    runs = result["runs"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(runs))
    ax.bar([i - 0.2 for i in x], [r["eager"]["median_step_ms"] for r in runs], 0.4,
           label="eager steps")  # fmt: skip
    ax.bar([i + 0.2 for i in x], [r["graphs"]["median_step_ms"] for r in runs], 0.4,
           label="CUDA graphs")  # fmt: skip
    ax.set_xticks(list(x), [f"batch {r['batch']}" for r in runs])
    ax.set_ylabel("ms per decode step (median)")
    ax.set_title(f"DeepSeek-V4 shape, 4 layers, {result['context']}-token prompts")
    ax.legend()
    save_figure(fig, out / "v4_engine_decode.png", 120)


if __name__ == "__main__":
    main()
