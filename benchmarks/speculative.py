"""Decode throughput with speculative decoding (n-gram or a draft model) against the same
engine without it.

    python benchmarks/speculative.py [--quick] [--device cuda] [--batch-sizes 1,2,4,8]
        [--method ngram|draft] [--draft-layers 2]

For each batch size B, B requests with a repetitive prompt (a 64-token block repeated with one
token changed per copy, as code edits and summaries that copy do) generate `--max-tokens`
tokens greedily (EOS ignored) on one engine without drafts and one with `ngram` drafts of
`--num-speculative-tokens` tokens (`--embedding-scale 10` makes the random model repeat its
last token, so drafts are accepted as a model copying its context would accept them). Both
engines run the same model and backend (CUDA graphs on where the device has them, for decode
steps with and without drafts); each run is timed after a warm-up run of the same batch.
Reported per batch size: generated tokens/s of each, their ratio, the acceptance rate and
accepted drafts per request-step, and whether greedy tokens are identical. The model:
`bench-llama-1b`, a random-weight Llama of 1.2B parameters (hidden 2048, 16 layers, 32 query /
8 KV heads of 64), or `tiny-llama` with `--quick`. With `--method draft` the drafts come from
a draft model of the same shape with `--draft-layers` layers (2: about 14% of the target's
parameters with the embeddings) whose (tied) embeddings are copied from the target after the
scaling: like a distilled draft, it then agrees with the target on this workload. Writes
`<out>/speculative[_draft].json` and `.png`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import attrs
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
from unified_attn.models import LayerKind
from unified_attn.models.presets import PRESETS, get_preset

BENCH_MODEL = "bench-llama-1b"
DRAFT_SUFFIX = "-draft"
BLOCK = 64  # tokens of the repeated prompt block


def register_bench_model() -> None:
    """A 1.2B-parameter Llama shape with random weights, as a preset of this process."""
    PRESETS[BENCH_MODEL] = attrs.evolve(
        get_preset("tiny-llama"),
        name=BENCH_MODEL,
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_size=64,
        max_position_embeddings=4096,
        layer_kinds=[LayerKind.full()] * 16,
    )


def register_draft_model(target: str, num_layers: int) -> str:
    """The target preset with `num_layers` layers, as a preset of this process."""
    name = target + DRAFT_SUFFIX
    PRESETS[name] = attrs.evolve(
        get_preset(target), name=name, num_layers=num_layers,
        layer_kinds=[LayerKind.full()] * num_layers,
    )  # fmt: skip
    return name


def repetitive_prompt(index: int, copies: int, vocab: int) -> list[int]:
    """`copies` copies of one 64-token block, one token changed per copy."""
    block = [(index * 7919 + j * 104729) % (vocab - 2) + 1 for j in range(BLOCK)]
    prompt = []
    for c in range(copies):
        edited = list(block)
        edited[(c * 13) % BLOCK] = (edited[(c * 13) % BLOCK] + c) % (vocab - 2) + 1
        prompt += edited
    return prompt


def timed_generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> Any:
    engine.generate(prompts, params)  # warm-up: the same shapes
    stats_before = attrs.evolve(engine.stats)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    stats = engine.stats
    drafted = stats.spec_drafted - stats_before.spec_drafted
    accepted = stats.spec_accepted - stats_before.spec_accepted
    verifications = stats.spec_verifications - stats_before.spec_verifications
    tokens = sum(len(o.output_token_ids) for o in outputs)
    return outputs, {
        "elapsed_s": elapsed,
        "generated_tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "steps": stats.steps - stats_before.steps,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "accepted_per_step": accepted / verifications if verifications else 0.0,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = "tiny-llama" if args.quick else BENCH_MODEL
    register_bench_model()
    memory = "64MiB" if args.device == "cpu" else "4GiB"  # two engines share the device
    common = dict(device=args.device, max_num_seqs=max(args.batch_sizes), seed=0,
                  max_model_len=2048, kv_cache_memory=memory, dtype=args.dtype)  # fmt: skip
    plain = LLMEngine(model, **common)
    method: dict[str, Any] = {"speculative_method": args.method}
    if args.method == "draft":
        method["draft_model"] = register_draft_model(model, args.draft_layers)
    spec = LLMEngine(model, num_speculative_tokens=args.num_speculative_tokens, **method, **common)
    for engine in (plain, spec):  # > 1: the random model mostly repeats its last token
        engine.model.model.embed_tokens.weight.mul_(args.embedding_scale)
    draft = getattr(spec.drafter, "source", None)
    if draft is not None:  # the draft reads and writes tokens as the target does
        draft.model.model.embed_tokens.weight.copy_(spec.model.model.embed_tokens.weight)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    vocab = plain.vocab_size
    rows = []
    for batch in args.batch_sizes:
        prompts = [repetitive_prompt(i, args.copies, vocab) for i in range(batch)]
        base_out, base = timed_generate(plain, prompts, params)
        spec_out, drafted = timed_generate(spec, prompts, params)
        same = [a.output_token_ids == b.output_token_ids
                for a, b in zip(base_out, spec_out, strict=True)]  # fmt: skip
        rows.append({
            "batch_size": batch,
            "plain": base,
            "speculative": drafted,
            "speedup": drafted["tokens_per_s"] / base["tokens_per_s"],
            "identical_tokens": all(same),
        })  # fmt: skip
    return {
        "benchmark": "speculative",
        "command": command_line("speculative.py", args.argv),
        "timestamp": utc_timestamp(),
        "machine": machine_info(),
        "model": model,
        "backend": plain.backend_cls.name,
        "device": args.device,
        "dtype": str(plain.model.dtype).removeprefix("torch."),
        "cuda_graphs": plain.runner.graphs is not None,
        "method": args.method,
        "draft_model": method.get("draft_model"),
        "params": {
            "draft_layers": args.draft_layers if args.method == "draft" else None,
            "num_speculative_tokens": args.num_speculative_tokens,
            "max_tokens": args.max_tokens,
            "prompt_tokens": BLOCK * args.copies,
            "embedding_scale": args.embedding_scale,
        },
        "rows": rows,
    }


def print_table(report: dict[str, Any]) -> None:
    console = make_console(110)
    out = table(
        f"{report['method']} speculation, {report['model']} on {report['device']} "
        f"({report['backend']})",
        ["batch", "plain tok/s", "spec tok/s", "speedup", "acceptance", "accepted/step",
         "identical"],
    )  # fmt: skip
    for row in report["rows"]:
        spec = row["speculative"]
        out.add_row(
            str(row["batch_size"]),
            f"{row['plain']['tokens_per_s']:.1f}",
            f"{spec['tokens_per_s']:.1f}",
            f"{row['speedup']:.2f}x",
            f"{spec['acceptance_rate']:.0%}",
            f"{spec['accepted_per_step']:.2f}",
            "yes" if row["identical_tokens"] else "NO",
        )
    console.print(out)


def plot(report: dict[str, Any], path: Any) -> None:
    plt = pyplot(make_console(110))
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    batches = [r["batch_size"] for r in report["rows"]]
    ax.plot(batches, [r["plain"]["tokens_per_s"] for r in report["rows"]], "o-", label="plain")
    spec = [r["speculative"]["tokens_per_s"] for r in report["rows"]]
    ax.plot(batches, spec, "o-", label=f"{report['method']} speculation")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("generated tokens/s")
    ax.set_title(f"{report['model']} on {report['device']}")
    ax.legend()
    save_figure(fig, path, dpi=120)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny-llama, short runs (CPU)")
    parser.add_argument("--device", default="cuda", help="cuda or cpu (default: cuda)")
    parser.add_argument("--batch-sizes", default="1,2,4,8", help="comma-separated")
    parser.add_argument("--method", default="ngram", choices=["ngram", "draft"])
    parser.add_argument("--draft-layers", type=int, default=2, help="layers of the draft model")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--copies", type=int, default=6, help="copies of the 64-token block")
    parser.add_argument("--dtype", default=None, help="model dtype (default: the device's)")
    parser.add_argument(
        "--embedding-scale",
        type=float,
        default=1.0,
        help="multiply the random model's (tied) embeddings: 10 makes it repeat its last token "
        "like a model copying its context, so drafts are accepted (default: 1)",
    )
    parser.add_argument("--no-plot", action="store_true")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.argv = argv
    if args.quick:
        args.max_tokens, args.copies = min(args.max_tokens, 24), min(args.copies, 2)
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    report = run(args)
    out = output_dir(args)
    name = "speculative" if args.method == "ngram" else "speculative_draft"
    write_json(out / f"{name}.json", report)
    print_table(report)
    if not args.no_plot:
        plot(report, out / f"{name}.png")
    return report


if __name__ == "__main__":
    main()
