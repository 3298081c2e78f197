"""`unified-attn run`'s report: built from the engine after the run (`make_report`,
`make_encode_report`) and printed as rich tables (`print_report`)."""

from __future__ import annotations

import argparse
from typing import Any

from unified_attn.engine.llm_engine import LLMEngine
from unified_attn.spec_decode.draft_model import DraftModelProposer


def make_encode_report(
    engine: LLMEngine, args: argparse.Namespace, outputs: list, setup_s: float, elapsed: float
) -> dict:
    """Encoder-only models: the workload's hidden states (`--max-tokens` is unused)."""
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
        "sample_outputs": [sample(out) for out in finished[:SAMPLES]],
    }


SAMPLES = 3  # generated outputs the report shows


def sample(out: Any) -> dict:
    """One output as the report shows it: its id, the text (None without a tokenizer), the
    token ids and why it ended."""
    completion = out.outputs[0]
    return {
        "request_id": out.request_id,
        "text": completion.text,
        "token_ids": completion.token_ids,
        "finish_reason": completion.finish_reason,
    }


def config_text(config: dict) -> str:
    """A manager config as `field=value` pairs, leaving out the fields that are off (None, 0,
    False): `sliding_window=32`, `mamba_cache_mode=align`."""
    return ", ".join(f"{k}={v}" for k, v in config.items() if v not in (None, 0, False))


def print_report(report: dict) -> None:
    from rich.table import Table

    from unified_attn.harness.report_console import ReportConsole

    console = ReportConsole()
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
        groups.add_row(str(g["group_id"]), g["manager"], config_text(g["config"]),
                       str(len(g["layers"])), f"{g['page_bytes']:,}",
                       str(g["blocks_per_request"]), f"{live['blocks_freed_early']:,}",
                       f"{live['hit_blocks']:,}")  # fmt: skip
    console.print(groups)
    summary = Table(title="Run", title_justify="left", show_header=False)
    rows = [
        ("model / backend", f"{report['model']} / {report['backend']} on {report['device']}"),
        ("KV cache", f"{kv['num_blocks']:,} blocks x {kv['bytes_per_block']:,} B "
                     f"(block size {kv['block_size']}, {report['kv_cache_dtype']}) = "
                     f"{kv['total_bytes'] / 2**20:.1f} MiB, from {kv['budget']}"),
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
    print_samples(console, report["sample_outputs"])


def print_samples(console: Any, samples: list[dict]) -> None:
    """A few generated outputs: the text, or the token ids of a model without a tokenizer."""
    from rich.table import Table

    table = Table(title="Generated (first requests)", title_justify="left")
    for column in ("request", "output", "finish"):
        table.add_column(column)
    for s in samples:
        shown = repr(s["text"]) if s["text"] is not None else f"token ids {s['token_ids']}"
        table.add_row(s["request_id"], shown, s["finish_reason"])
    console.print(table)


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
