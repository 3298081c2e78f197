"""The `unified-attn run` command: its parser, the engine settings, a workload of requests with
shared prefixes (checked to fit `max_model_len`, never cut), the run itself and its report (JSON
or rich tables)."""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

from unified_attn.harness.conformance.prepare import (
    DTYPES,
    add_cwd_to_path,
    kv_cache_dtype,
    memory_size,
    positive_int,
)
from unified_attn.runner.config import EVICTION_POLICIES
from unified_attn.runner.draft_model import DraftModelProposer
from unified_attn.runner.engine import LLMEngine
from unified_attn.runner.model_source import DEFAULT_MODEL
from unified_attn.runner.speculative import SPECULATIVE_METHODS
from unified_attn.sampling_params import SamplingParams

# The workload: every request is one of NUM_PREFIXES shared prefixes (random ids, or the given
# prompt) followed by its own random tail.
NUM_PREFIXES = 4
PREFIX_TOKENS = 96
TAIL_TOKENS = (8, 48)


def add_parser(commands: Any) -> None:
    run = commands.add_parser(
        "run", help="generate for a workload of requests with shared prefixes and report"
    )
    run.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="preset or checkpoint directory (see `unified-attn models`)",
    )
    run.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    run.add_argument(
        "--backend",
        default=None,
        help="registered name, legacy-reference / legacy-triton, or module:Class of "
        "a native or four-class backend (see `unified-attn backends`; default: the "
        "highest-priority backend valid for the model)",
    )
    run.add_argument(
        "--dtype",
        default=None,
        choices=DTYPES,
        help="model dtype (default: float32 on CPU, bfloat16 on CUDA)",
    )
    run.add_argument("--num-requests", type=positive_int, default=32, help="requests to run")
    run.add_argument(
        "--max-tokens", type=positive_int, default=32, help="tokens to generate per request"
    )
    run.add_argument(
        "--kv-cache-memory",
        type=memory_size,
        default=None,
        help="KV-cache budget, e.g. 64MiB, 2GiB (default: 64MiB on CPU, on CUDA "
        "0.9 of the free memory)",
    )
    run.add_argument(
        "--kv-cache-dtype",
        type=kv_cache_dtype,
        default="auto",
        help="auto (the model dtype) or fp8 (float8 e4m3 with per-layer scales: half the bytes "
        "of bfloat16, twice the tokens)",
    )
    run.add_argument(
        "--block-size",
        type=positive_int,
        default=None,
        help="tokens per block (default: 16, or what every backend accepts)",
    )
    run.add_argument("--max-num-seqs", type=positive_int, default=64, help="requests per step")
    run.add_argument(
        "--max-num-batched-tokens", type=positive_int, default=512, help="tokens per step"
    )
    run.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="tokens per request, prompt and output (default: the model's max_position_embeddings)",
    )
    run.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    run.add_argument("--seed", type=int, default=0, help="seed of weights, workload, sampling")
    prompt = run.add_mutually_exclusive_group()
    prompt.add_argument(
        "--prompt",
        default=None,
        help=f"shared prompt text (default: {NUM_PREFIXES} prefixes of {PREFIX_TOKENS} random ids)",
    )
    prompt.add_argument(
        "--prompt-ids",
        type=token_ids,
        default=None,
        help="shared prompt as token ids, e.g. 1,2,3 (for models without a tokenizer)",
    )
    run.add_argument(
        "--speculative-method",
        default=None,
        choices=SPECULATIVE_METHODS,
        help="speculative decoding: drafts verified in the decode step, from ngram (prompt "
        "lookup) or draft (a --draft-model)",
    )
    run.add_argument(
        "--draft-model",
        default=None,
        help="the draft model of --speculative-method draft: a preset or checkpoint directory "
        "sharing the model's tokenizer",
    )
    run.add_argument(
        "--num-speculative-tokens",
        type=positive_int,
        default=None,
        help="draft tokens per request and step (with --speculative-method)",
    )
    run.add_argument(
        "--tensor-parallel-size",
        type=positive_int,
        default=1,
        help="ranks of tensor parallelism, one process each (gloo on CPU, NCCL on CUDA)",
    )
    run.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    run.add_argument(
        "--kv-cache-eviction",
        default="lru",
        choices=EVICTION_POLICIES,
        help="which cached block a new block evicts: lru (vLLM's order) or window_aware (blocks "
        "no prefix hit can use first)",
    )
    run.add_argument("--batch-invariant", action="store_true", help="only batch-invariant backends")
    run.add_argument("--json", action="store_true", help="print the report as JSON only")
    run.set_defaults(handler=main)


def token_ids(text: str) -> list[int]:
    """argparse type: comma-separated token ids."""
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token ids such as 1,2,3, got {text!r}"
        ) from None
    return ids


def main(args: argparse.Namespace) -> int:
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print_report(report)
    return 0


def engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = {
        "device": args.device,
        "backend": args.backend,
        "dtype": args.dtype,
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "enable_prefix_caching": not args.no_prefix_caching,
        "kv_cache_eviction": args.kv_cache_eviction,
        "tensor_parallel_size": args.tensor_parallel_size,
        "batch_invariant": args.batch_invariant,
        "kv_cache_dtype": args.kv_cache_dtype,
        "seed": args.seed,
        "speculative_method": args.speculative_method,
        "num_speculative_tokens": args.num_speculative_tokens,
        "draft_model": args.draft_model,
    }
    on_cpu = args.device.partition(":")[0] == "cpu"
    kwargs["kv_cache_memory"] = args.kv_cache_memory or ("64MiB" if on_cpu else None)
    return kwargs


def make_workload(engine: LLMEngine, args: argparse.Namespace) -> list[list[int]]:
    """Requests sharing one of the prefixes (or the given prompt), each with its own tail;
    refused, not cut, when the longest request and its output do not fit max_model_len."""
    rng = random.Random(args.seed)
    prefixes = shared_prefixes(engine, args, rng)
    check_fits(engine, args, max(len(p) for p in prefixes))
    vocab = engine.vocab_size
    return [
        prefixes[i % len(prefixes)]
        + [rng.randrange(vocab) for _ in range(rng.randint(*TAIL_TOKENS))]
        for i in range(args.num_requests)
    ]


def shared_prefixes(
    engine: LLMEngine, args: argparse.Namespace, rng: random.Random
) -> list[list[int]]:
    if args.prompt_ids is not None:
        return [list(args.prompt_ids)]
    if args.prompt is not None:
        if engine.tokenizer is None:
            raise ValueError(
                f"--prompt: model {args.model!r} has no tokenizer to encode text; pass token "
                "ids with --prompt-ids 1,2,3 or add the tokenizer files (tokenizer.json) to "
                "the checkpoint directory"
            )
        return [engine.tokenize(args.prompt)]
    return [[rng.randrange(engine.vocab_size) for _ in range(PREFIX_TOKENS)]
            for _ in range(NUM_PREFIXES)]  # fmt: skip


def check_fits(engine: LLMEngine, args: argparse.Namespace, prefix_len: int) -> None:
    """The longest request (prefix, longest tail) plus `--max-tokens` must fit max_model_len.
    Encoder-decoder models: the prompt is the encoder's input and must fit its limit, the
    decoder generates after its start token; encoder-only models generate nothing."""
    if engine.kind == "encoder_decoder":
        check_encoder_fits(engine, args, prefix_len)
        return
    output = 0 if engine.kind == "encoder_only" else args.max_tokens
    needed = prefix_len + TAIL_TOKENS[1] + output
    if needed <= engine.max_model_len:
        return
    option = prompt_option(args)
    prefix = f"the {prefix_len}-token {option}" if option else f"a {prefix_len}-token prefix"
    raise ValueError(
        f"requests need up to {needed} tokens ({prefix}, a tail of up to {TAIL_TOKENS[1]} "
        f"tokens and --max-tokens {args.max_tokens}) but max_model_len is "
        f"{engine.max_model_len}; " + " or ".join(fixes(engine, args, prefix_len, needed))
    )


def check_encoder_fits(engine: LLMEngine, args: argparse.Namespace, prefix_len: int) -> None:
    limit = engine.prompts.max_encoder_len or 0
    needed = prefix_len + TAIL_TOKENS[1]
    if needed > limit:
        option = prompt_option(args) or "--prompt-ids"
        raise ValueError(
            f"encoder prompts need up to {needed} tokens (a {prefix_len}-token prefix and a tail "
            f"of up to {TAIL_TOKENS[1]}) but the model's encoder takes at most {limit}; give "
            f"{option} of at most {max(limit - TAIL_TOKENS[1], 1)} tokens"
        )
    if 1 + args.max_tokens > engine.max_model_len:
        raise ValueError(
            f"--max-tokens {args.max_tokens} does not fit the decoder's max_model_len "
            f"{engine.max_model_len} after its start token; lower --max-tokens to at most "
            f"{engine.max_model_len - 1}"
        )


def prompt_option(args: argparse.Namespace) -> str | None:
    if args.prompt is not None:
        return "--prompt"
    return "--prompt-ids" if args.prompt_ids is not None else None


def fixes(engine: LLMEngine, args: argparse.Namespace, prefix_len: int, needed: int) -> list[str]:
    """What would fit: fewer output tokens, a shorter prompt, a longer max_model_len."""
    room = engine.max_model_len - prefix_len - TAIL_TOKENS[1]
    shorter = prefix_len - (needed - engine.max_model_len)
    option = prompt_option(args)
    found = []
    if room >= 1:
        found.append(f"lower --max-tokens to at most {room}")
    if option and shorter >= 1:
        found.append(f"shorten {option} to at most {shorter} tokens")
    if needed <= engine.model.config.max_position_embeddings:
        found.append(f"raise --max-model-len to at least {needed}")
    return found or ["give a shorter prompt with --prompt-ids"]


def run(args: argparse.Namespace) -> dict:
    add_cwd_to_path()  # `--backend module:Class` from the working directory
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    start = time.perf_counter()
    engine = LLMEngine(args.model, **engine_kwargs(args))
    setup_s = time.perf_counter() - start
    try:
        return run_workload(engine, args, params, setup_s)
    finally:
        engine.shutdown()  # the other tensor-parallel ranks, if any


def run_workload(
    engine: LLMEngine, args: argparse.Namespace, params: SamplingParams, setup_s: float
) -> dict:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    workload = make_workload(engine, args)
    if engine.kind == "encoder_only":
        return run_encode(engine, args, workload, setup_s)
    for ids in workload:
        # an encoder-decoder model reads the workload as encoder inputs
        prompt = {"encoder_prompt_token_ids": ids} if engine.kind == "encoder_decoder" else ids
        engine.add_request(prompt, params)
    finished = []
    run_start = time.perf_counter()
    columns = ("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())  # fmt: skip
    with Progress(*columns, disable=args.json, transient=True) as progress:
        task = progress.add_task("generating", total=args.num_requests)
        while engine.has_unfinished_requests():
            done = engine.step()
            finished.extend(done)
            progress.advance(task, len(done))
    elapsed = time.perf_counter() - run_start
    return make_report(engine, args, finished, setup_s, elapsed)


def run_encode(
    engine: LLMEngine, args: argparse.Namespace, workload: list[list[int]], setup_s: float
) -> dict:
    """Encoder-only models: the workload's hidden states, timed (`--max-tokens` is unused)."""
    start = time.perf_counter()
    outputs = engine.encode(workload)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {
        "model": args.model,
        "device": args.device,
        "backend": engine.backend_cls.name,
        "mode": "encode",
        "num_requests": len(outputs),
        "kv_cache": engine.kv_cache_report.as_dict(),
        "encoded_tokens": tokens,
        "encoded_tokens_per_s": tokens / elapsed if elapsed else 0.0,
        "hidden_size": int(outputs[0].hidden_states.shape[1]),
        "setup_s": setup_s,
        "elapsed_s": elapsed,
    }


def make_report(engine: LLMEngine, args, finished, setup_s: float, elapsed: float) -> dict:
    stats = engine.stats
    prefix = engine.kv_cache_manager.prefix_cache_stats
    draft = engine.drafter if isinstance(engine.drafter, DraftModelProposer) else None
    return {
        "model": args.model,
        "device": args.device,
        "backend": engine.backend_cls.name,
        "mode": "generate",
        "num_requests": len(finished),
        "kv_cache": engine.kv_cache_report.as_dict(),
        "kv_cache_dtype": engine.config.kv_cache_dtype,
        "rank_num_blocks": engine.rank_num_blocks,
        "prefix_cache": {
            "queries": prefix.queries,
            "hits": prefix.hits,
            "hit_rate": prefix.hit_rate,
        },
        "preemptions": engine.scheduler.num_preemptions,
        "groups_at_runtime": engine.kv_cache_manager.group_stats(),
        "steps": stats.steps,
        "prefill_tokens": stats.prefill_tokens,
        "generated_tokens": stats.generated_tokens,
        "generated_tokens_per_s": stats.generated_tokens / elapsed if elapsed else 0.0,
        "total_tokens_per_s": (stats.prefill_tokens + stats.decode_tokens) / elapsed
        if elapsed
        else 0.0,
        "mean_step_ms": stats.mean_step_ms,
        "draft_kv_cache": None if draft is None else draft.worker.report().as_dict(),
        "speculative": {
            "method": args.speculative_method,
            "draft_model": args.draft_model,
            "drafted": stats.spec_drafted,
            "accepted": stats.spec_accepted,
            "acceptance_rate": stats.spec_acceptance_rate,
            "mean_accepted_per_step": stats.mean_accepted_per_step,
        },
        "setup_s": setup_s,
        "elapsed_s": elapsed,
        "sample_output": finished[0].text if finished and finished[0].text is not None else None,
    }


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    kv = report["kv_cache"]
    if report["mode"] == "encode":
        print_encode_report(console, report)
        return
    groups = Table(title="KV-cache groups", title_justify="left")
    columns = ("group", "manager", "config", "layers", "page bytes", "blocks/request",
               "freed early", "hit blocks")  # fmt: skip
    for column in columns:
        groups.add_column(column)
    for g, live in zip(kv["groups"], report["groups_at_runtime"], strict=True):
        groups.add_row(str(g["group_id"]), g["manager"], str(g["config"] or ""),
                       str(len(g["layers"])), f"{g['page_bytes']:,}",
                       str(g["blocks_per_request"]), f"{live['blocks_freed_early']:,}",
                       f"{live['hit_blocks']:,}")  # fmt: skip
    console.print(groups)
    summary = Table(title="Run", title_justify="left", show_header=False)
    rows = [
        ("model / backend", f"{report['model']} / {report['backend']} on {report['device']}"),
        ("KV cache", f"{kv['num_blocks']:,} blocks x {kv['bytes_per_block']:,} B "
                     f"(block size {kv['block_size']}, {report['kv_cache_dtype']}) = "
                     f"{kv['total_bytes'] / 2**20:.1f} MiB"),
        ("blocks per rank", ", ".join(f"{n:,}" for n in report["rank_num_blocks"])
         + f" (all ranks use {kv['num_blocks']:,})"),
        ("capacity", f"{kv['capacity_tokens']:,} tokens, max concurrency "
                     f"{kv['max_concurrency']:.1f} at max_model_len {kv['max_model_len']}"),
        ("requests", str(report["num_requests"])),
        ("prefix hit rate", f"{report['prefix_cache']['hit_rate']:.1%}"),
        ("preemptions", str(report["preemptions"])),
        ("generated tokens/s", f"{report['generated_tokens_per_s']:.1f}"),
        ("total tokens/s", f"{report['total_tokens_per_s']:.1f}"),
        ("mean step", f"{report['mean_step_ms']:.2f} ms over {report['steps']} steps"),
    ]  # fmt: skip
    spec = report["speculative"]
    if spec["method"]:
        rows.append((
            f"speculative ({spec['method']})",
            f"{spec['accepted']:,} of {spec['drafted']:,} drafts accepted "
            f"({spec['acceptance_rate']:.0%}), {spec['mean_accepted_per_step']:.2f} per "
            "request-step",
        ))  # fmt: skip
    draft = report["draft_kv_cache"]
    if draft is not None:
        rows.append((
            f"draft model {spec['draft_model']}",
            f"KV cache {draft['num_blocks']:,} blocks x {draft['bytes_per_block']:,} B = "
            f"{draft['total_bytes'] / 2**20:.1f} MiB, {draft['capacity_tokens']:,} tokens",
        ))  # fmt: skip
    for key, value in rows:
        summary.add_row(key, value)
    console.print(summary)


def print_encode_report(console: Any, report: dict) -> None:
    from rich.table import Table

    summary = Table(title="Encode", title_justify="left", show_header=False)
    rows = [
        ("model / backend", f"{report['model']} / {report['backend']} on {report['device']}"),
        ("KV cache", f"none ({len(report['kv_cache']['groups'])} groups: encoder-only model)"),
        ("requests", str(report["num_requests"])),
        ("hidden states", f"{report['encoded_tokens']:,} tokens x {report['hidden_size']}"),
        ("encoded tokens/s", f"{report['encoded_tokens_per_s']:.1f}"),
    ]
    for key, value in rows:
        summary.add_row(key, value)
    console.print(summary)
