"""Host time of whole engine decode steps with the model's forward stubbed out: what the host
spends per step besides the device, phase by phase (issue 37: this bounds the step rate once
overlap hides the rest, and a tensor-parallel step that is shorter on the device).

    python benchmarks/host_step.py [--quick] [--requests 64,256,512] [--out DIR]

An `LLMEngine` of `tiny-llama` takes N requests of 128-token prompts and decodes; its runner's
forward and its sampler's device work are left out: the sampler picks, at each position, the
next token of an encoded text (`SCRIPT`: so the detokenizer sees real text, and stop strings
none), so a step is the engine's host work alone: `schedule` (the scheduler and the KV-cache
manager), `inputs and sampling` (the runner's `execute` without the forward and the sampling's
device work: input layout, metadata, recording the tokens),
`update` (the scheduler taking the sampled tokens: stops, block hashes), `outputs` (the request
tracker: detokenizing, stop strings, building each request's output) and `step` (the whole
`engine.step()`). Each N runs with streamed outputs (`RequestOutputKind.DELTA`, an output per
request per step, as a serving loop streams them) and with final outputs only (`FINAL_ONLY`,
as `LLM.generate`). Median microseconds per step over the timed steps, after warm-up; the
steps are plain (no device to overlap with), the garbage collector frozen as the engine does.
`--tokenizer` picks the tokenizer: `bytes` (tiny-llama's own, one token per UTF-8 byte),
`bpe` (a byte-level BPE of 8,000 tokens trained on the repository's `docs/*.md`, the kind of
fast (Rust) tokenizer real checkpoints ship) or a checkpoint directory's; a fast tokenizer runs
with both incremental detokenizers, its one-token stream and the window decode, in the same
run. Writes `DIR/host_step.json`.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from common import (
    add_out_argument,
    csv_ints,
    make_console,
    output_dir,
    run_header,
    summary,
    table,
    time_method,
    write_json,
)

from unified_attn import LLMEngine, SamplingParams
from unified_attn.models.tokenizer import HFTokenizer, load_tokenizer
from unified_attn.runner.sampler import SamplerOutput
from unified_attn.sampling_params import RequestOutputKind

SCHEMA = "unified_attn.benchmarks.host_step/v1"
PROMPT_LEN = 128
DOCS = Path(__file__).resolve().parents[1] / "docs"
PHASES = ("schedule", "inputs and sampling", "update", "outputs", "step")


class PhaseClock:
    """Wraps the engine's phase methods; each call's host time goes to its phase."""

    def __init__(self, engine: LLMEngine) -> None:
        self.times: dict[str, list[float]] = {phase: [] for phase in PHASES}
        self.on = False
        time_method(engine.scheduler, "schedule", functools.partial(self._add, "schedule"))
        time_method(engine.runner, "execute", functools.partial(self._add, "inputs and sampling"))
        time_method(engine.scheduler, "update_from_output", functools.partial(self._add, "update"))
        time_method(engine._requests, "advance", functools.partial(self._add, "outputs"))
        time_method(engine, "step", functools.partial(self._add, "step"))

    def _add(self, phase: str, seconds: float) -> None:
        if self.on:
            self.times[phase].append(seconds * 1e6)


SCRIPT = (
    "Paged attention reads the KV cache block by block, and prefix caching shares the full "
    "blocks of a prompt between requests. Ünïcödé text, 日本語, emoji 🙂 and math ∑ √ too. "
) * 8


def bpe_tokenizer(directory: Path) -> HFTokenizer:
    """A byte-level BPE of 8,000 tokens trained on the repository's docs (`--tokenizer bpe`)."""
    import tokenizers
    import transformers

    pre = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw = tokenizers.Tokenizer(tokenizers.models.BPE())
    raw.pre_tokenizer, raw.decoder = pre, tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=8000, special_tokens=["<s>", "</s>"], initial_alphabet=pre.alphabet()
    )
    raw.train([str(p) for p in sorted(DOCS.glob("*.md"))], trainer)
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>"
    ).save_pretrained(directory)
    return HFTokenizer(directory)


def stub_forward(engine: LLMEngine, script: list[int]) -> None:
    """The runner's forward returns a placeholder for the rows it samples, and its sampler
    picks `script`'s token at each request's next position (the device's work, left out)."""

    def logits(output: Any, inputs: Any, result: Any) -> torch.Tensor | None:
        rows = len(inputs.sample_rows)
        return torch.zeros(rows, 1) if rows else None

    def sample(logits: torch.Tensor, requests: Sequence[Any]) -> SamplerOutput:
        tokens = [script[r.num_tokens % len(script)] for r in requests]
        return SamplerOutput(tokens, [None] * len(requests))

    engine.runner._logits = logits  # type: ignore[method-assign]
    engine.runner.sampler.sample = sample  # type: ignore[method-assign]


def measure(
    requests: int, kind: RequestOutputKind, warmup: int, steps: int, tokenizer: Any
) -> dict[str, Any]:
    engine = LLMEngine(
        "tiny-llama", max_model_len=PROMPT_LEN + warmup + steps + 64, max_num_seqs=requests,
        max_num_batched_tokens=PROMPT_LEN * requests, kv_cache_memory="512MiB",
        async_scheduling=False,
    )  # fmt: skip
    if tokenizer is not None:
        engine.tokenizer = tokenizer
    stub_forward(engine, engine.tokenizer.encode(SCRIPT))
    clock = PhaseClock(engine)
    params = SamplingParams(max_tokens=warmup + steps + 32, ignore_eos=True, output_kind=kind)
    for i in range(requests):
        prompt = [(i * 7919 + j) % 256 for j in range(PROMPT_LEN)]
        engine.add_request(f"r{i}", prompt, params)
    engine.step()  # every prompt in one step
    assert all(r.num_output_tokens == 1 for r in engine.scheduler.requests.values())
    for _ in range(warmup):
        engine.step()
    clock.on = True
    for _ in range(steps):
        engine.step()
    clock.on = False
    engine.shutdown()
    return {"requests": requests, "output_kind": kind.name, "steps": steps,
            "us": {phase: summary(values) for phase, values in clock.times.items()}}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=csv_ints, default=[64, 256, 512])
    parser.add_argument("--quick", action="store_true", help="8 and 16 requests, few steps")
    parser.add_argument("--tokenizer", default="bytes", help="bytes, bpe or a checkpoint dir")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    os.environ.setdefault("UNIFIED_ATTN_FREEZE_GC", "1")
    sizes, warmup, steps = ([8, 16], 2, 4) if args.quick else (args.requests, 8, 40)
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = pick_tokenizer(parser, args.tokenizer, Path(scratch))
        rows = []
        for n in sizes:
            for kind in (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY):
                for detok, tok in detokenizers(tokenizer):
                    rows.append({**measure(n, kind, warmup, steps, tok), "detokenizer": detok})
    report = {**run_header(SCHEMA, "host_step.py", args.quick, argv), "prompt_len": PROMPT_LEN,
              "tokenizer": args.tokenizer, "results": rows}  # fmt: skip
    print_table(report, make_console(120).print)
    write_json(output_dir(args) / "host_step.json", report)
    return report


def pick_tokenizer(parser: argparse.ArgumentParser, name: str, scratch: Path) -> Any:
    """None for the model's own (`bytes`); a trained BPE; or a checkpoint directory's."""
    if name == "bytes":
        return None
    if name == "bpe":
        return bpe_tokenizer(scratch)
    tokenizer = load_tokenizer(name)
    if tokenizer is None:
        parser.error(f"--tokenizer: expected bytes, bpe or a directory with tokenizer files, "
                     f"got {name!r}")  # fmt: skip
    return tokenizer


def detokenizers(tokenizer: Any) -> list[tuple[str, Any]]:
    """A fast tokenizer both ways, its one-token stream and the window decode (a copy without
    `decode_stream`), measured in the same run; the byte tokenizer has only windows."""
    if tokenizer is None or getattr(tokenizer, "decode_stream", None) is None:
        return [("windows", tokenizer)]
    windows = copy.copy(tokenizer)
    windows.decode_stream = None
    return [("stream", tokenizer), ("windows", windows)]


def print_table(report: dict[str, Any], show: Callable[[Any], None]) -> None:
    t = table(f"host time per decode step (median us), forward stubbed, tokenizer "
              f"{report['tokenizer']}", ["requests", "outputs", "detokenizer", *PHASES,
              "per request"])  # fmt: skip
    for r in report["results"]:
        us = {phase: r["us"][phase]["median"] for phase in PHASES}
        per_request = f"{us['step'] / r['requests']:.1f}"
        t.add_row(str(r["requests"]), r["output_kind"], r["detokenizer"],
                  *(f"{us[p]:,.0f}" for p in PHASES), per_request)  # fmt: skip
    show(t)


if __name__ == "__main__":
    main()
