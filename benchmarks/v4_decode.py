"""DeepSeek-V4 decode attention on the Triton kernel: a CSA layer's two partial attentions (the
sliding window of latents and the top-k compressed entries), in one run with the copy ceiling
and the reference (torch gather + einsum) peer.

    python benchmarks/v4_decode.py [--out DIR] [--batch 64] [--context 65536] [--quick]
                                   [--sweep [--configs CONFIG,...]]

CONFIG: BH/TILE/WARPS/STAGES/AHEAD[/MAXNREG[/SPLITS]] (`parse_configs`).

Shape (issue 10): 64 query heads of 512 (shared-KV MQA), window 128, compression rate 4, top-k
512, batch 64, 64k context, bf16, page 64 for the latents (16 entries per compressed page).
Each request's window is its last 128 positions; its top-k names 512 random complete entries.
Bytes the layer touches per token (`layer_bytes`): (128 + 512) rows of 512 bf16 and their list
entries (int64 block, int64 slot, bool visibility), its 64 query rows read once and its output
written once (51.0 MB a step). Target: the layer's attention within 1.5x of the time to move
those bytes at the measured device-to-device copy bandwidth (bytes read + written of a 2 GiB
copy); every implementation's figure is against that same time. (Before 2026-11-24 the layer's
figure counted the query and the output once per set, as the two partial launches touch them:
58.7 MB, so the ratios reported then were 13% low.)

What is timed, each as the backends call it (int64 lists, a bool mask), captured in a CUDA graph
over `--rotations` steps of distinct requests (4 x 51 MB between reuses, more than L2's 50
MB), the graph's median time over its calls:
- "layer": the layer's attention as the engine runs it, `gathered_attention_sets` over the
  window's and the top-k's rows with the sinks (on sm90 one launch), against the reference's
  `attend_row_sets` (torch gather + einsum per set, merged with the sinks);
- "swa" and "compressed": each user's own partial softmax (`gathered_attention`), and "two
  launches", both back to back in one graph (the layer before the one-launch kernel, without
  its merge).
Writes `DIR/v4_decode.json`.
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

import attrs
import torch
from common import (
    add_out_argument,
    command_line,
    machine_info,
    output_dir,
    utc_timestamp,
    write_json,
)

from unified_attn.backends.deepseek_v4_steps import partial_attention
from unified_attn.backends.triton.v4_ops import gathered_attention

TARGET = 1.5


def copy_tb_s() -> float:
    from common import gpu_ms

    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / gpu_ms(functools.partial(dst.copy_, src)) / 1e9


ROTATIONS = 4  # distinct requests per timed call: 4 x 51 MB between reuses, L2 holds 50 MB


def make_case(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The caches, then `ROTATIONS` decode steps of `batch` distinct requests each over them:
    queries, and each request's window and top-k rows as the backends pass them (int64 block
    ids and slots, a bool mask) (random data)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, ctx, d, page = args.batch * args.rotations, args.context, args.head_size, args.page
    entries = ctx // args.rate
    per = page // args.rate  # compressed entries per page
    pages, entry_pages = ctx // page, entries // per
    latents = torch.randn(b * pages + 1, page, d, device="cuda", generator=gen,
                          dtype=torch.bfloat16)  # fmt: skip
    compressed = torch.randn(b * entry_pages + 1, per, d, device="cuda", generator=gen,
                             dtype=torch.bfloat16)  # fmt: skip
    table = torch.randperm(b * pages, device="cuda", generator=gen).view(b, pages) + 1
    entry_table = torch.randperm(b * entry_pages, device="cuda", generator=gen).view(b, -1) + 1
    steps = []
    for r in range(args.rotations):
        rows = torch.arange(r * args.batch, (r + 1) * args.batch, device="cuda")[:, None]
        window = torch.arange(ctx - args.window, ctx, device="cuda").expand(args.batch, -1)
        picks = torch.rand(args.batch, entries, device="cuda", generator=gen)
        picks = picks.topk(args.topk, dim=1).indices
        steps.append({
            "q": torch.randn(args.batch, args.heads, d, device="cuda", generator=gen,
                             dtype=torch.bfloat16),
            "swa": (latents, table[rows, window // page], window % page),
            "compressed": (compressed, entry_table[rows, picks // per], picks % per),
            "sinks": torch.randn(args.heads, device="cuda", generator=gen),
        })  # fmt: skip
    return steps


def launches(steps: list[dict[str, Any]], scale: float, config: Any = None) -> dict[str, Any]:
    """Per implementation and partial, one call per step (each with its own output buffers)."""
    calls: dict[str, Any] = {"triton": {}, "reference": {}}
    for name in ("swa", "compressed"):
        for impl in calls:
            calls[impl][name] = [_call(step, name, impl, scale, config) for step in steps]
    return calls


def _call(step: dict[str, Any], name: str, impl: str, scale: float, config: Any) -> Any:
    q = step["q"]
    cache, blocks, offsets = step[name]
    valid = torch.ones(blocks.shape, dtype=torch.bool, device="cuda")
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], device="cuda")

    def run() -> torch.Tensor:
        if impl == "triton":
            gathered_attention(q, cache, blocks, offsets, valid, scale, out, lse, config)
        else:
            partial_attention(q, cache[blocks, offsets], valid, scale, out, lse)
        return out

    return run


def interleave(calls: dict[str, list[Any]]) -> list[Any]:
    """Each step's two launches in the order a CSA layer runs them: window, then compressed."""
    return [c for pair in zip(calls["swa"], calls["compressed"], strict=True) for c in pair]


def graph_us(calls: list[Any]) -> float:
    """µs per call: the calls captured back to back in one CUDA graph (as a decode step runs)."""
    from attn_bench.timing import time_calls

    ms, how = time_calls(calls, graph=True)
    if not how.startswith("cuda_graph"):
        raise RuntimeError(f"v4_decode: timing fell back to {how}")
    return ms * 1e3 if calls else float("nan")


# heads, tile, warps, stages, entries a tile ahead (1/0)[, max registers (0: none)[, splits of
# each list (0: auto)]]: shapes that fit shared memory
SWEEP: list[tuple[int, ...]] = [
    *[(64, t, 8, st, 1, 0, sp) for t, st in [(32, 3), (64, 2)] for sp in (1, 2, 4)],
    *[(64, 64, 16, 2, 1, 0, sp) for sp in (2, 4)],
    *[(32, t, w, st, 1, 0, sp) for t, w, st in [(32, 4, 3), (64, 8, 3)] for sp in (1, 2)],
    *[(16, 32, 4, 3, 1), (32, 32, 8, 3, 1, 128)],
]


# The Hopper kernel (sm90 only): rows per tile, ring buffers, splits (0: auto)[, programs per
# token and head group (halves of the outputs)[, the query in registers (1/0)]]
SM90_SWEEP = [
    *[(64, 2, 1, h) for h in (1, 2)],  # one program per token and head group, or two halves
    *[(32, 4, 1, h) for h in (1, 2)],
    (64, 2, 2, 1),  # each list split over two programs and merged
    (32, 4, 2, 2),
]


def parse_configs(text: str) -> list[tuple[int, ...]]:
    """`BH/TILE/WARPS/STAGES/AHEAD[/MAXNREG[/SPLITS]],...` (empty: `SWEEP`); one line and exit 2
    when malformed."""
    try:
        configs = [tuple(int(x) for x in c.split("/")) for c in text.split(",") if c]
        if any(
            len(c) not in (5, 6, 7)
            or min(c[:4]) < 1
            or c[4] not in (0, 1)
            or min(c[5:], default=0) < 0
            for c in configs
        ):
            raise ValueError
    except ValueError:
        print(f"--configs takes BH/TILE/WARPS/STAGES/AHEAD[/MAXNREG[/SPLITS]],... (AHEAD 0 or 1; "
              f"MAXNREG 0: no cap; SPLITS 0: auto), got {text!r}", file=sys.stderr)  # fmt: skip
        raise SystemExit(2) from None
    return configs or SWEEP


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in [("batch", 64), ("context", 65536), ("heads", 64), ("head-size", 512),
                          ("window", 128), ("rate", 4), ("topk", 512), ("page", 64),
                          ("rotations", ROTATIONS)]:  # fmt: skip
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--quick", action="store_true", help="batch 4, 8k context")
    parser.add_argument("--sweep", action="store_true", help="also time kernel configurations")
    parser.add_argument(
        "--configs",
        default="",
        help="sweep only these: BH/TILE/WARPS/STAGES/AHEAD[/MAXNREG[/SPLITS]],...",
    )
    add_out_argument(parser)
    args = parser.parse_args(argv)
    configs = parse_configs(args.configs)
    if args.quick:
        args.batch, args.context = 4, 8192
    if not torch.cuda.is_available():
        print("benchmarks/v4_decode.py needs a CUDA GPU", file=sys.stderr)
        raise SystemExit(2)
    steps = make_case(args)
    calls = launches(steps, args.head_size**-0.5)
    result: dict[str, Any] = {"benchmark": "v4_decode",
                              "command": command_line("v4_decode.py", argv),
                              "timestamp": utc_timestamp(), "machine": machine_info(),
                              "shape": vars(args), "copy_tb_s": copy_tb_s()}  # fmt: skip
    q_bytes = steps[0]["q"].numel() * 2 * 2  # read q, write the output
    for name in ("swa", "compressed"):
        touched = steps[0][name][1].numel() * args.head_size * 2 + q_bytes
        got, want = (calls[impl][name][0]().float().clone() for impl in ("triton", "reference"))
        result[name] = {"bytes": touched, "max_diff": (got - want).abs().max().item()}
        result[name].update({f"{impl}_us": graph_us(calls[impl][name]) for impl in calls})
    both = {impl: 2 * graph_us(interleave(calls[impl])) for impl in calls}  # µs per step
    total_bytes = layer_bytes(steps[0], args.head_size)
    ideal_us = total_bytes / result["copy_tb_s"] / 1e6
    layer = layer_calls(steps, args.head_size**-0.5)
    got, want = (layer[impl][0]().float().clone() for impl in ("triton", "reference"))
    us = {impl: graph_us(layer[impl]) for impl in layer}
    result["total"] = {"bytes": total_bytes, "ideal_us": ideal_us, "triton_us": us["triton"],
                       "reference_us": us["reference"], "max_diff": (got - want).abs().max().item(),
                       "over_ideal": us["triton"] / ideal_us,
                       "tb_s": total_bytes / us["triton"] / 1e6, "target": TARGET,
                       "met": us["triton"] / ideal_us <= TARGET,
                       "speedup_over_reference": us["reference"] / us["triton"],
                       "two_launches_us": both["triton"],
                       "two_launches_over_ideal": both["triton"] / ideal_us}  # fmt: skip
    print(f"[v4_decode] copy {result['copy_tb_s']:.2f} TB/s", flush=True)
    for name in ("swa", "compressed"):
        r = result[name]
        print(f"[v4_decode] {name}: triton {r['triton_us']:.1f} us, reference "
              f"{r['reference_us']:.1f} us, {r['bytes'] / 1e6:.1f} MB, max diff "
              f"{r['max_diff']:.3g}", flush=True)  # fmt: skip
    t = result["total"]
    print(f"[v4_decode] two partial launches {t['two_launches_us']:.1f} us = "
          f"{t['two_launches_over_ideal']:.2f}x the copy time", flush=True)  # fmt: skip
    print(f"[v4_decode] layer {t['triton_us']:.1f} us = {t['over_ideal']:.2f}x the copy "
          f"time of {t['bytes'] / 1e6:.1f} MB ({t['tb_s']:.2f} TB/s), target <= {TARGET}x: "
          f"{'met' if t['met'] else 'missed'}; {t['speedup_over_reference']:.1f}x the reference "
          f"(max diff {t['max_diff']:.3g})", flush=True)  # fmt: skip
    if args.sweep:
        result["sweep"] = sweep(steps, args.head_size**-0.5, configs)
    write_json(output_dir(args) / "v4_decode.json", result)
    return result


def layer_bytes(step: dict[str, Any], head_size: int) -> int:
    """The bytes the layer's attention must touch in one step: every row of both sets (bf16),
    the query read once and the output written once, and each row's list entry (int64 block,
    int64 slot, bool visibility)."""
    rows = sum(step[name][1].numel() for name in ("swa", "compressed"))
    return rows * head_size * 2 + step["q"].numel() * 2 * 2 + rows * (8 + 8 + 1)


def layer_calls(steps: list[dict[str, Any]], scale: float) -> dict[str, list[Any]]:
    """Per implementation, one call per step of the layer's attention over both sets of rows
    with the sinks (each with its own output buffer)."""
    from unified_attn.backends.deepseek_v4_steps import GatheredRows, attend_row_sets
    from unified_attn.backends.triton.v4_ops import gathered_attention_sets

    calls: dict[str, list[Any]] = {"triton": [], "reference": []}
    for step in steps:
        q, out = step["q"], torch.empty_like(step["q"])
        sets = [GatheredRows(*step[name], torch.ones(step[name][1].shape, dtype=torch.bool,
                                                     device="cuda"))
                for name in ("swa", "compressed")]  # fmt: skip
        for impl, fn in (("triton", gathered_attention_sets), ("reference", attend_row_sets)):
            calls[impl].append(functools.partial(_layer, fn, q, sets, scale, step["sinks"], out))
    return calls


def _layer(fn: Any, q: torch.Tensor, sets: Any, scale: float, sinks: torch.Tensor,
           out: torch.Tensor) -> torch.Tensor:  # fmt: skip
    fn(q, sets, scale, sinks, out)
    return out


def gather_config_of(config: tuple[int, ...]) -> Any:
    """`GatherConfig` of a parsed `--configs` entry."""
    from unified_attn.backends.triton.v4_ops import GatherConfig

    heads, tile, warps, stages, ahead, cap, splits = (*config, *(0, 1)[len(config) - 5 :])
    return GatherConfig(heads, tile, warps, stages, bool(ahead), cap or None, splits)


def sweep(
    steps: list[dict[str, Any]], scale: float, configs: list[tuple[int, ...]]
) -> list[dict[str, Any]]:
    """Kernel configurations on both lists: µs per launch, graph-timed like the main figure."""
    from unified_attn.backends.triton.v4_ops import Sm90GatherConfig

    rows = []
    hopper = torch.cuda.get_device_capability() == (9, 0)
    hopper_configs = [Sm90GatherConfig(*c) for c in SM90_SWEEP]
    for config in [*configs, *(hopper_configs if hopper else [])]:
        cfg = config if isinstance(config, Sm90GatherConfig) else gather_config_of(config)
        row: dict[str, Any] = {"kernel": type(cfg).__name__, **attrs.asdict(cfg)}
        calls = launches(steps, scale, cfg)["triton"]
        for name in ("swa", "compressed"):
            try:
                row[f"{name}_us"] = graph_us(calls[name])
            except Exception as error:  # out of resources
                row[f"{name}_us"] = float("nan")
                row["error"] = f"{type(error).__name__}: {str(error)[:120]}"
                torch.cuda.synchronize()
        rows.append(row)
        print(f"[v4_decode] {cfg}: swa {row['swa_us']:.1f} us, compressed "
              f"{row['compressed_us']:.1f} us", flush=True)  # fmt: skip
    good = [r for r in rows if "error" not in r]
    for key in ("swa_us", "compressed_us"):
        best = min(good, key=lambda r: r[key], default=None)
        print(f"[v4_decode] best for {key}: {best}", flush=True)
    return rows


if __name__ == "__main__":
    main()
