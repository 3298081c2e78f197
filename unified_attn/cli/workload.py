"""`unified-attn run`'s workload: requests with shared prefixes (checked to fit
`max_model_len`, never cut), generated for (or, for encoder-only models, encoded) and timed."""

from __future__ import annotations

import argparse
import random
import time

from unified_attn.cli.run_report import make_encode_report, make_report
from unified_attn.engine.llm_engine import LLMEngine
from unified_attn.runner.memory import format_memory, host_memory_bytes
from unified_attn.sampling_params import SamplingParams

# The workload: every request is one of NUM_PREFIXES shared prefixes (random ids, or the given
# prompt) followed by its own random tail.
NUM_PREFIXES = 4
PREFIX_TOKENS = 96
TAIL_TOKENS = (8, 48)


def make_workload(engine: LLMEngine, args: argparse.Namespace) -> list[list[int]]:
    """Requests sharing one of the prefixes (or the given prompt), each with its own tail;
    refused, not cut, when the longest request and its output do not fit max_model_len."""
    rng = random.Random(args.seed)
    prefixes = shared_prefixes(engine, args, rng)
    check_fits(engine, args, max(len(p) for p in prefixes))
    check_host_memory(args, max(len(p) for p in prefixes))
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


# host bytes a queued request's tokens take, per token: the prompt's ids are held as Python
# ints in several lists (the workload, the request's prompt and all-token lists)
BYTES_PER_QUEUED_TOKEN = 3 * 8 + 28


def check_host_memory(args: argparse.Namespace, prefix_len: int) -> None:
    """Refuse, up front, a workload whose queued prompts would not fit half this machine's
    memory (they are all queued at once)."""
    memory = host_memory_bytes()
    per_request = (prefix_len + TAIL_TOKENS[1] + args.max_tokens) * BYTES_PER_QUEUED_TOKEN
    if memory is None or args.num_requests * per_request <= memory // 2:
        return
    most = max(memory // 2 // per_request, 1)
    raise ValueError(
        f"--num-requests {args.num_requests} would queue about "
        f"{format_memory(args.num_requests * per_request)} of prompts, more than half of this "
        f"machine's {format_memory(memory)}; give --num-requests {most} or fewer"
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
        engine.add_request(None, prompt, params)
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
    return make_encode_report(engine, args, outputs, setup_s, elapsed)
