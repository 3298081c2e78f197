"""DeepSeek-V4's lightning-indexer scores: the Triton kernel against the reference gather +
einsum, same run, with the time to read the keys at the measured copy bandwidth.

    python benchmarks/v4_indexer.py [--out DIR] [--quick]

Shape: 64 indexer heads of 128, compression rate 4, bf16 keys in pages of 16 entries (64
tokens), scale 128**-0.5. Cases (each token's keys are its request's complete entries):
- "decode": 64 requests, one token each, 64k context (16,384 entries, all seen);
- "graph decode": the same step as a CUDA graph plans it for a `max_model_len` of 64k, with
  8k-token requests: 16,384 entries per row, of which each token sees 2,048;
- "prefill chunk": one request, 2,048 new tokens at positions 6,144 .. 8,191 (2,048 entries,
  each token seeing its complete ones).
Per case: the median time of each (`triton.testing.do_bench`), the memory each allocates
beyond its inputs and output (peak), the bytes of keys the tokens must read (each request's
seen entries once) and the kernel's time against reading them at the copy bandwidth (the
decode cases' measure: they read each key for one token), and its multiply-adds per second
(the prefill chunk's: every key serves up to 2,048 tokens). Writes
`DIR/v4_indexer.json`.
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

import torch
from common import (
    add_out_argument,
    command_line,
    gpu_ms,
    machine_info,
    output_dir,
    utc_timestamp,
    write_json,
)

from unified_attn.backends.deepseek_v4_compressed import index_scores
from unified_attn.backends.triton.indexer_ops import indexer_scores

HEADS, WIDTH, RATE, ENTRIES_PER_PAGE = 64, 128, 4, 16


def make_case(requests: int, tokens_per_request: int, context: int, entries: int,
              seen: int | None = None) -> dict[str, Any]:  # fmt: skip
    """Random keys and queries; request r's entries in pages of its own; the step's last
    `tokens_per_request` tokens of each request at `context`; rows of `entries` entries, each
    token seeing its complete ones (or `seen`)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    pages = entries // ENTRIES_PER_PAGE
    cache = torch.randn(requests * pages + 1, ENTRIES_PER_PAGE, WIDTH, device="cuda",
                        generator=gen, dtype=torch.bfloat16)  # fmt: skip
    table = torch.randperm(requests * pages, device="cuda", generator=gen).view(requests, pages)
    entry = torch.arange(entries, device="cuda")
    blocks = table[:, entry // ENTRIES_PER_PAGE] + 1
    tokens = requests * tokens_per_request
    request = torch.arange(tokens, device="cuda") // tokens_per_request
    positions = context - tokens_per_request + torch.arange(tokens, device="cuda") % (
        tokens_per_request
    )
    visible = (positions + 1) // RATE if seen is None else torch.full_like(positions, seen)
    return {
        "args": (
            torch.randn(tokens, HEADS, WIDTH, device="cuda", generator=gen, dtype=torch.bfloat16),
            torch.rand(tokens, HEADS, device="cuda", generator=gen),
            cache, blocks, entry % ENTRIES_PER_PAGE, request, visible, WIDTH**-0.5,
        ),
        "out": torch.empty(tokens, entries, device="cuda"),
        # each request's seen entries, read once (the most any of its tokens sees)
        "key_bytes": int(visible.view(requests, -1).amax(1).sum()) * WIDTH * 2,
        # a multiply-add per head, feature and seen entry of each token
        "flops": 2 * HEADS * WIDTH * int(visible.sum()),
    }  # fmt: skip


def measure(case: dict[str, Any], fn: Any) -> dict[str, float]:
    out = torch.empty_like(case["out"])
    call = functools.partial(fn, *case["args"], out)
    call()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    return {"ms": gpu_ms(call), "extra_bytes": extra, "out": out}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 requests, 8k context")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/v4_indexer.py needs a CUDA GPU", file=sys.stderr)
        raise SystemExit(2)
    from v4_decode import copy_tb_s

    scale = 8 if args.quick else 1  # --quick: a smaller context
    requests = 4 if args.quick else 64
    cases = {
        "decode": make_case(requests, 1, 65536 // scale, 16384 // scale),
        "graph decode": make_case(requests, 1, 8192, 16384 // scale, seen=2048 // scale),
        "prefill chunk": make_case(1, 2048, 8192, 2048),
    }
    copy = copy_tb_s()
    result: dict[str, Any] = {"benchmark": "v4_indexer",
                              "command": command_line("v4_indexer.py", argv),
                              "timestamp": utc_timestamp(), "machine": machine_info(),
                              "copy_tb_s": copy, "cases": {}}  # fmt: skip
    for name, case in cases.items():
        triton_run, reference = measure(case, indexer_scores), measure(case, index_scores)
        seen = torch.isfinite(reference["out"])
        diff = (triton_run["out"][seen] - reference["out"][seen]).abs().max().item()
        ideal_ms = case["key_bytes"] / copy / 1e9
        row = {"tokens": case["out"].shape[0], "entries": case["out"].shape[1],
               "key_bytes": case["key_bytes"], "triton_ms": triton_run["ms"],
               "reference_ms": reference["ms"], "speedup": reference["ms"] / triton_run["ms"],
               "triton_extra_bytes": triton_run["extra_bytes"],
               "reference_extra_bytes": reference["extra_bytes"],
               "over_copy_time": triton_run["ms"] / ideal_ms, "max_diff": diff,
               "triton_tflops": case["flops"] / triton_run["ms"] / 1e9,
               "same_infinities": torch.equal(seen, torch.isfinite(triton_run["out"]))}  # fmt: skip
        result["cases"][name] = row
        print(f"[v4_indexer] {name}: triton {1e3 * row['triton_ms']:.1f} us "
              f"({row['over_copy_time']:.2f}x the copy time of {row['key_bytes'] / 1e6:.1f} MB of "
              f"keys, {row['triton_tflops']:.1f} TFLOP/s, {row['triton_extra_bytes'] / 1e6:.1f} "
              f"MB extra), reference "
              f"{1e3 * row['reference_ms']:.1f} us ({row['reference_extra_bytes'] / 1e6:.1f} MB "
              f"extra): {row['speedup']:.1f}x; max diff {diff:.3g}", flush=True)  # fmt: skip
    write_json(output_dir(args) / "v4_indexer.json", result)
    return result


if __name__ == "__main__":
    main()
