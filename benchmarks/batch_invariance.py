"""What batch-invariant mode costs: decode and prefill throughput of the same model with the
mode off and on, in one run.

    python benchmarks/batch_invariance.py [--quick] [--device cuda] [--model bench-llama-1b]
        [--decode-batch 64] [--decode-steps 128] [--prefill-batch 16] [--prefill-len 1024]

Two engines load the same model (same seed: the same random weights) with the same options,
`batch_invariant=False` and `True`; prefix caching is off so repeated prompts are recomputed.

- decode: `--decode-batch` requests of `--prompt-len` tokens are prefilled, then
  `--decode-steps` decode steps of the whole batch are timed (CUDA graphs where the device has
  them): generated tokens/s. Target: invariant >= 0.8x the default.
- prefill: `--prefill-batch` prompts of `--prefill-len` tokens generating one token each,
  after a warm-up run of the same shapes: prompt tokens/s. Target: invariant >= 0.7x.
- invariance: the first decode request's logits are compared with the same request run alone
  (bitwise, both modes): the mode's guarantee at the benchmark's shapes.
- matmul (CUDA only): each linear shape of the model at the decode batch and at a prefill step
  (`--prefill-batch * --prefill-len` rows, capped at 8192), torch against the invariant Triton
  matmul (`triton.testing.do_bench` medians): where the time goes, for tuning
  `matmul_config`.

The model: `bench-llama-1b` (1.2B-parameter Llama, as `speculative.py`), `bench-moe-1b` (a
GPT-OSS-shaped MoE of ~1.1B parameters) or any preset; `tiny-llama` on the CPU with `--quick`.
Writes `<out>/batch_invariance.json` and `.png`.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Sequence
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
    status_markup,
    table,
    utc_timestamp,
    write_json,
)

from unified_attn import LLMEngine, SamplingParams
from unified_attn.models import LayerKind, MoEConfig
from unified_attn.models.presets import PRESETS, get_preset
from unified_attn.sampling_params import RequestOutputKind

DECODE_TARGET, PREFILL_TARGET = 0.8, 0.7
MODES = {"default": False, "invariant": True}
PARAMS = ("decode_batch", "decode_steps", "warmup_steps", "prompt_len", "prefill_batch",
          "prefill_len", "budget")  # fmt: skip


def register_bench_models() -> None:
    """`bench-llama-1b` (the shape of `speculative.py`'s) and `bench-moe-1b`: 16 layers,
    hidden 2048, 32 query / 8 KV heads of 64, vocabulary 32000; the MoE has 8 experts of 1024
    (top 2), GPT-OSS's biases, sinks and alternating sliding-128 / full layers."""
    llama = attrs.evolve(
        get_preset("tiny-llama"), name="bench-llama-1b", vocab_size=32000, hidden_size=2048,
        intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8, head_size=64,
        max_position_embeddings=4096, layer_kinds=(LayerKind.full(),) * 16,
    )  # fmt: skip
    moe = attrs.evolve(
        get_preset("gpt-oss-like"), name="bench-moe-1b", vocab_size=32000, hidden_size=2048,
        intermediate_size=1024, num_layers=16, num_heads=32, num_kv_heads=8, head_size=64,
        moe=MoEConfig(num_experts=8, top_k=2), max_position_embeddings=4096,
        layer_kinds=(LayerKind.sliding(128, has_sinks=True), LayerKind.full(has_sinks=True)) * 8,
    )  # fmt: skip
    PRESETS.update({llama.name: llama, moe.name: moe})


def use_dense_experts() -> None:
    """In this process, the mode's experts run their dense reference loop (each product an
    invariant matmul), as the mode did before the grouped kernels took one configuration."""
    from unified_attn.models.invariant import model

    for cls in (model.InvariantExperts, model.InvariantRoutedExperts):
        cls.forward = cls.reference  # type: ignore[method-assign]


def prompt(index: int, length: int, vocab: int) -> list[int]:
    return [(index * 7919 + j * 104729) % (vocab - 2) + 1 for j in range(length)]


def make_engine(args: argparse.Namespace, invariant: bool) -> LLMEngine:
    return LLMEngine(
        args.model, device=args.device, dtype=args.dtype, batch_invariant=invariant, seed=0,
        max_num_seqs=max(args.decode_batch, args.prefill_batch),
        max_num_batched_tokens=args.budget, max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=False,
    )  # fmt: skip


# ---- decode ----------------------------------------------------------------------------------


def run_decode(engine: LLMEngine, args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    """Prefill the batch, then time `decode_steps` steps of it: tokens/s, and the first
    request's generated-token logits (for the invariance check)."""
    vocab, batch = engine.vocab_size, args.decode_batch
    total = args.decode_steps + args.warmup_steps + 1
    params = SamplingParams(
        max_tokens=total, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    first = engine.add_request(None, prompt(0, args.prompt_len, vocab),
                               attrs.evolve(params, return_logits=True))  # fmt: skip
    for i in range(1, batch):
        engine.add_request(None, prompt(i, args.prompt_len, vocab), params)
    outputs: dict[str, Any] = {}
    while engine.stats.prefill_tokens < batch * args.prompt_len:
        _collect(outputs, engine.step())
    for _ in range(args.warmup_steps):
        _collect(outputs, engine.step())
    before = attrs.evolve(engine.stats)
    start = time.perf_counter()
    for _ in range(args.decode_steps):
        _collect(outputs, engine.step())
    elapsed = time.perf_counter() - start
    tokens = engine.stats.generated_tokens - before.generated_tokens
    while engine.has_unfinished_requests():
        _collect(outputs, engine.step())
    row = {
        "batch": batch,
        "steps": args.decode_steps,
        "elapsed_s": elapsed,
        "tokens_per_s": tokens / elapsed,
        "ms_per_step": 1e3 * elapsed / args.decode_steps,
    }
    return row, outputs[first].logits


def _collect(outputs: dict[str, Any], finished: list[Any]) -> None:
    outputs.update({o.request_id: o for o in finished})


def alone_logits(engine: LLMEngine, args: argparse.Namespace) -> torch.Tensor:
    total = args.decode_steps + args.warmup_steps + 1
    params = SamplingParams(max_tokens=total, ignore_eos=True, return_logits=True)
    out = engine.generate([prompt(0, args.prompt_len, engine.vocab_size)], params)[0]
    return out.logits


# ---- prefill ---------------------------------------------------------------------------------


def run_prefill(engine: LLMEngine, args: argparse.Namespace) -> dict[str, Any]:
    """Prompt tokens/s of a batch of prompts generating one token each, after a warm-up."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    vocab = engine.vocab_size
    prompts = [prompt(1000 + i, args.prefill_len, vocab) for i in range(args.prefill_batch)]
    engine.generate(prompts, params)  # warm-up: the same shapes (no prefix cache)
    if args.device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = args.prefill_batch * args.prefill_len
    return {"prompts": args.prefill_batch, "prompt_len": args.prefill_len,
            "elapsed_s": elapsed, "tokens_per_s": tokens / elapsed}  # fmt: skip


# ---- matmuls (CUDA) --------------------------------------------------------------------------


def linear_shapes(engine: LLMEngine) -> list[tuple[str, int, int]]:
    """(name, N, K) of each distinct linear weight of layer 0 and the LM head."""
    shapes: dict[tuple[int, int], str] = {}
    layer = engine.model.model.layers[0]
    for name, module in layer.named_modules():
        if isinstance(module, torch.nn.Linear):
            shapes.setdefault(tuple(module.weight.shape), name)
    config = engine.model.config
    shapes.setdefault((config.vocab_size, config.hidden_size), "lm_head")
    return [(name, n, k) for (n, k), name in shapes.items()]


def run_matmuls(engine: LLMEngine, args: argparse.Namespace) -> list[dict[str, Any]]:
    from common import gpu_ms

    from unified_attn.kernels.invariant import invariant_launch as triton_ops

    rows = []
    dtype = engine.model.dtype
    prefill_rows = min(args.prefill_batch * args.prefill_len, 8192, args.budget)
    for name, n, k in linear_shapes(engine):
        weight = torch.randn(n, k, device="cuda", dtype=dtype) * k**-0.5
        for m in (args.decode_batch, prefill_rows):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            torch_ms = gpu_ms(lambda x=x, w=weight: torch.nn.functional.linear(x, w))
            ours_ms = gpu_ms(lambda x=x, w=weight: triton_ops.matmul(x, w.t()))
            rows.append({"layer": name, "m": m, "n": n, "k": k, "torch_ms": torch_ms,
                         "invariant_ms": ours_ms, "ratio": torch_ms / ours_ms})  # fmt: skip
    return rows


# ---- the run ---------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    register_bench_models()
    if args.dense_experts:
        use_dense_experts()
    results: dict[str, dict[str, Any]] = {}
    invariance: dict[str, bool] = {}
    matmuls: list[dict[str, Any]] = []
    for mode, invariant in MODES.items():
        engine = make_engine(args, invariant)
        decode, batch_logits = run_decode(engine, args)
        invariance[mode] = bool(torch.equal(batch_logits, alone_logits(engine, args)))
        results[mode] = {"decode": decode, "prefill": run_prefill(engine, args),
                         "backend": engine.backend_cls.name,
                         "cuda_graphs": engine.runner.graphs is not None}  # fmt: skip
        if invariant and args.device == "cuda" and not args.no_matmuls:
            matmuls = run_matmuls(engine, args)
        dtype = str(engine.model.dtype).removeprefix("torch.")
        del engine
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return {
        "benchmark": "batch_invariance",
        "command": command_line("batch_invariance.py", args.argv),
        "timestamp": utc_timestamp(),
        "machine": machine_info(),
        "model": args.model,
        "device": args.device,
        "dtype": dtype,
        "params": {key: getattr(args, key) for key in PARAMS},
        "dense_experts": args.dense_experts,
        "modes": results,
        "ratios": ratios(results),
        "invariance_alone_vs_batch": invariance,
        "matmul": matmuls,
    }


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    def ratio(kind: str) -> float:
        ours = results["invariant"][kind]["tokens_per_s"]
        return float(ours / results["default"][kind]["tokens_per_s"])

    decode, prefill = ratio("decode"), ratio("prefill")
    return {
        "decode": decode, "decode_target": DECODE_TARGET, "decode_met": decode >= DECODE_TARGET,
        "prefill": prefill, "prefill_target": PREFILL_TARGET,
        "prefill_met": prefill >= PREFILL_TARGET,
    }  # fmt: skip


# ---- report ----------------------------------------------------------------------------------


def print_table(report: dict[str, Any]) -> None:
    console = make_console(110)
    out = table(
        f"batch-invariant mode, {report['model']} on {report['device']} ({report['dtype']})",
        ["phase", "default tok/s", "invariant tok/s", "ratio", "target", "status"],
    )
    modes, r = report["modes"], report["ratios"]
    for phase in ("decode", "prefill"):
        out.add_row(
            phase,
            f"{modes['default'][phase]['tokens_per_s']:.1f}",
            f"{modes['invariant'][phase]['tokens_per_s']:.1f}",
            f"{r[phase]:.2f}x",
            f">= {r[phase + '_target']}x",
            status_markup(r[phase + "_met"]),
        )
    console.print(out)
    same = report["invariance_alone_vs_batch"]
    console.print(f"logits alone == in the decode batch: default {same['default']}, "
                  f"invariant {same['invariant']}")  # fmt: skip
    if report["matmul"]:
        mm = table("matmuls (ms, do_bench median)", ["layer", "M", "N", "K", "torch", "invariant",
                                                      "ratio"])  # fmt: skip
        for row in report["matmul"]:
            mm.add_row(row["layer"], str(row["m"]), str(row["n"]), str(row["k"]),
                       f"{row['torch_ms']:.4f}", f"{row['invariant_ms']:.4f}",
                       f"{row['ratio']:.2f}x")  # fmt: skip
        console.print(mm)


def plot(report: dict[str, Any], path: Any) -> None:
    plt = pyplot(make_console(110))
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    phases = ["decode", "prefill"]
    for offset, mode in ((-0.2, "default"), (0.2, "invariant")):
        values = [report["modes"][mode][p]["tokens_per_s"] for p in phases]
        ax.bar([i + offset for i in range(2)], values, width=0.4, label=mode)
    for i, phase in enumerate(phases):
        ax.annotate(f"{report['ratios'][phase]:.2f}x", (i, 0), ha="center", va="bottom")
    ax.set_xticks(range(2), [f"decode (batch {report['params']['decode_batch']})", "prefill"])
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{report['model']} on {report['device']}: batch-invariant mode")
    ax.legend()
    save_figure(fig, path, dpi=120)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny-llama on the CPU, short runs")
    parser.add_argument("--device", default="cuda", help="cuda or cpu (default: cuda)")
    parser.add_argument("--model", default="bench-llama-1b", help="a preset (see above)")
    parser.add_argument("--dtype", default=None, help="model dtype (default: the device's)")
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=128)
    parser.add_argument("--warmup-steps", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256, help="decode requests' prompts")
    parser.add_argument("--prefill-batch", type=int, default=16)
    parser.add_argument("--prefill-len", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", default="8GiB", help="per engine")
    parser.add_argument("--no-matmuls", action="store_true", help="skip the matmul table")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument(
        "--dense-experts", action="store_true",
        help="the mode's MoE as before 2026-11-24: every expert on every token (comparison)",
    )  # fmt: skip
    add_out_argument(parser)
    args = parser.parse_args(argv)
    args.argv = argv
    if args.quick:
        args.model, args.device = "tiny-llama", "cpu"
        args.decode_batch, args.decode_steps, args.warmup_steps = 4, 4, 1
        args.prompt_len, args.prefill_batch, args.prefill_len = 16, 2, 32
        args.budget, args.max_model_len, args.kv_cache_memory = 256, 128, "64MiB"
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    report = run(args)
    out = output_dir(args)
    write_json(out / "batch_invariance.json", report)
    print_table(report)
    if not args.no_plot:
        plot(report, out / "batch_invariance.png")
    return report


if __name__ == "__main__":
    main()
