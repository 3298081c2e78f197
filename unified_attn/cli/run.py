"""The `unified-attn run` command: its parser, the engine settings and the run; the workload it
generates for is `cli/workload.py`, its report `cli/run_report.py`."""

from __future__ import annotations

import argparse
import json
import re
import time
from typing import Any

from rich.console import Console

from unified_attn.cli.arguments import (
    DTYPES,
    add_cwd_to_path,
    kv_cache_dtype,
    memory_size,
    non_negative_float,
    positive_int,
    seed,
    text_value,
)
from unified_attn.cli.run_report import print_report
from unified_attn.cli.workload import NUM_PREFIXES, PREFIX_TOKENS, run_workload
from unified_attn.engine.engine_config import EVICTION_POLICIES, STATE_CACHE_MODES
from unified_attn.engine.llm_engine import LLMEngine
from unified_attn.runner.model_source import DEFAULT_MODEL
from unified_attn.sampling_params import RequestOutputKind, SamplingParams
from unified_attn.spec_decode.proposers import SPECULATIVE_METHODS


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
    run.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 is greedy")
    run.add_argument("--seed", type=seed, default=0, help="seed of weights, workload, sampling")
    prompt = run.add_mutually_exclusive_group()
    prompt.add_argument(
        "--prompt",
        type=text_value,
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
    run.add_argument(
        "--mamba-cache-mode",
        default=None,
        choices=STATE_CACHE_MODES,
        help="state layers' prefix caching: align (vLLM's: a checkpoint when a step ends on a "
        "block boundary), all (at every boundary a step crosses), none (default: none with "
        "speculative decoding, else align)",
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
        "mamba_cache_mode": args.mamba_cache_mode,
        "tensor_parallel_size": args.tensor_parallel_size,
        "batch_invariant": args.batch_invariant,
        "kv_cache_dtype": args.kv_cache_dtype,
        "seed": args.seed,
        "speculative_method": args.speculative_method,
        "num_speculative_tokens": args.num_speculative_tokens,
        "draft_model": args.draft_model,
    }
    kwargs["kv_cache_memory"] = args.kv_cache_memory
    return kwargs


def as_flags(message: str, options: list[str]) -> str:
    """An engine message in the command's words: `speculative_method='draft'` and
    `draft_model` become `--speculative-method 'draft'` and `--draft-model` (options with an
    underscore only, so plain words stay)."""
    for name in sorted((o for o in options if "_" in o), key=len, reverse=True):
        flag = "--" + name.replace("_", "-")
        message = re.sub(rf"\b{name}=", flag + " ", message)
        message = re.sub(rf"(?<![-\w.]){name}\b", flag, message)
    return message


def run(args: argparse.Namespace) -> dict:
    add_cwd_to_path()  # `--backend module:Class` from the working directory
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        output_kind=RequestOutputKind.FINAL_ONLY,  # the report counts finished requests
    )
    start = time.perf_counter()
    kwargs = engine_kwargs(args)
    try:
        with Console(stderr=True).status(f"loading {args.model} and sizing its KV cache"):
            engine = LLMEngine(args.model, **kwargs)
    except ValueError as error:
        raise ValueError(as_flags(str(error), list(kwargs))) from None
    setup_s = time.perf_counter() - start
    try:
        return run_workload(engine, args, params, setup_s)
    finally:
        engine.shutdown()  # the other tensor-parallel ranks, if any
