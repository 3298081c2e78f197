"""Gated delta rule kernels (`backends/triton/gated_delta_ops.py`, Qwen3-Next's linear attention)
at Qwen3-Next-80B-A3B's shapes (Hk=16, Hv=32, Dk=Dv=128, bfloat16 inputs, float32 states),
against vLLM 0.33's fla kernels as same-run peers.

    python benchmarks/vllm_peers.py /path/to/vllm-0.33.0-*.whl   # once, where vLLM is
    python benchmarks/gated_delta_kernels.py [--out DIR] [--quick]

- decode (`gated_delta_update`, q/k normalised in the kernel), batch 1..256: read == write
  slot, each launch replayed from a CUDA graph that cycles over disjoint blocks (as
  `ssm_kernels.py`). Reported: us per launch, state bytes read + written / time as a fraction
  of the device-to-device copy bandwidth measured in this run (target >= 0.7), a tile sweep.
  Peers: fla's `fused_recurrent_gated_delta_rule` on the same q, k, v, g, beta
  (`vllm_fused_recurrent_*`) and `fused_recurrent_gated_delta_rule_packed_decode`, what vLLM's
  Qwen3-Next layer runs for non-speculative decode (packed qkv rows, raw gates chosen to give
  the same g and beta: `vllm_packed_*`).
- prefill (`gated_delta_chunked_varlen`), one request and four, fresh requests reading random
  states: our chunked (WY) path (`ours_ms`; `ours_wy_ms`: its parallel half alone; a sweep of
  its state tiles), our token-by-token kernel (`tokens_ms`), fla's `chunk_gated_delta_rule`
  with `cu_seqlens`, the chunk indices precomputed (as vLLM's metadata builder),
  `initial_state`, `output_final_state` and `use_qk_l2norm_in_kernel=True` on the same raw q,
  k (`vllm_ms`; the gather of its initial states and the scatter of its final states, which
  ours does in the kernel, are left out of its time), fla on q, k normalised beforehand
  (`vllm_prenorm_ms`: vLLM's own prefill, whose L2 norm is fused into an earlier kernel), and
  the torch chunked form (`gated_delta_math`). `triton.testing.do_bench` medians; ours and
  fla's two calls timed in turn three times (`common.paired_ms`, each round in `rounds_ms`),
  the median reported.

Every peer has `vllm_over_ours` (time ratio: > 1 means we are faster) and `max_rel_diff` of its
outputs and states against ours on the same inputs (`tokens_max_rel_diff`: the token kernel
against the chunked path). Writes `DIR/gated_delta_kernels.json` after every section. Without
the peers folder only our kernels run.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from common import (
    add_out_argument,
    gpu_ms,
    make_console,
    output_dir,
    paired_ms,
    run_header,
    table,
    warm_up_gpu,
    write_json,
)
from gated_delta_peer_calls import fla_decode, fla_layout, fla_packed_decode, fla_prefill, load_fla
from ssm_kernels import copy_bandwidth, graph_us, rel_diff, rotations

SCHEMA = "unified_attn.benchmarks.gated_delta_kernels/v2"
HK, HV, DK, DV = 16, 32, 128, 128
SCALE = DK**-0.5
DECODE_BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
PREFILL = [[2048], [8192], [512] * 4, [2048] * 4]
TILE_SWEEP = [(bv, w) for bv in (8, 16, 32, 64) for w in (1, 2, 4, 8)]
# one stage is left out: Triton 3.6 reads shared memory out of bounds at (32, 4, 1) on an H200
CHUNKED_SWEEP = [(bv, w, s) for bv in (16, 32, 64) for w in (4, 8) for s in (2, 3)]
DT = torch.bfloat16
SECTIONS = ("decode", "prefill")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_out_argument(ap)
    ap.add_argument("--quick", action="store_true", help="a few shapes, for a smoke run")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated: any of {', '.join(SECTIONS)}")  # fmt: skip
    args = ap.parse_args(argv)
    args.sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    unknown = sorted(set(args.sections) - set(SECTIONS)) or ([] if args.sections else ["(none)"])
    if unknown:
        ap.error(f"--sections: expected any of {', '.join(SECTIONS)}, got {', '.join(unknown)}")
    args.argv = argv
    return args


def rule_inputs(rows: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device="cuda")

    return {"q": randn(rows, HK, DK).to(DT), "k": randn(rows, HK, DK).to(DT),
            "v": randn(rows, HV, DV).to(DT), "g": -torch.rand(rows, HV, device="cuda") * 0.5,
            "beta": torch.rand(rows, HV, device="cuda")}  # fmt: skip


# ---- decode ----------------------------------------------------------------------------------


def bench_decode(batch: int, copy_bw: float, sweep: bool, fla: Any) -> dict[str, Any]:
    from unified_attn.backends.triton import gated_delta_ops as ops

    state_bytes = 2 * batch * HV * DK * DV * 4
    turns = rotations(state_bytes)
    inp = rule_inputs(batch, seed=batch)
    pool = torch.randn(1 + batch * turns, HV, DK, DV, device="cuda") * 0.1  # 0: vLLM's null
    slots = [torch.arange(1 + i * batch, 1 + (i + 1) * batch, dtype=torch.int32, device="cuda")
             for i in range(turns)]  # fmt: skip
    o = torch.empty_like(inp["v"])

    def at(block_v: int, warps: int) -> float:
        launches = [
            lambda s=s: ops.launch_update(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                          pool, s, s, o, SCALE, True, block_v, warps)
            for s in slots
        ]  # fmt: skip
        return graph_us(launches)

    us = at(*ops.update_tiles(DK, DV, batch))
    row: dict[str, Any] = {"batch": batch, "ours_us": us,
                           "ours_copy_fraction": state_bytes / (us * 1e-6) / copy_bw}  # fmt: skip
    if sweep:
        tiles = {f"{bv}x{w}": at(bv, w) for bv, w in TILE_SWEEP}
        best = min(tiles, key=tiles.__getitem__)
        row.update(tiles_us=tiles, best_tiles=best,
                   best_copy_fraction=state_bytes / (tiles[best] * 1e-6) / copy_bw)  # fmt: skip
    if fla is not None:
        row.update(decode_peers(fla, inp, pool, slots, us, state_bytes, copy_bw))
    return row


def decode_peers(
    fla: Any, inp: dict, pool: torch.Tensor, slots: list[torch.Tensor], ours_us: float,
    state_bytes: int, copy_bw: float,
) -> dict[str, Any]:  # fmt: skip
    from unified_attn.backends.triton.gated_delta_ops import gated_delta_update

    states = fla_layout(pool)
    row: dict[str, Any] = {}
    for name, make in (("fused_recurrent", fla_decode), ("packed", fla_packed_decode)):
        peer = make(fla, inp, states, SCALE)
        us = graph_us([lambda s=s, peer=peer: peer(s) for s in slots])
        first, before = slots[0].long(), pool[slots[0].long()].clone()
        o = gated_delta_update(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool,
                               slots[0], slots[0], SCALE, l2norm=True)  # fmt: skip
        states[first] = fla_layout(before)
        o_peer = peer(slots[0]).clone()
        diff = max(rel_diff(o_peer, o), rel_diff(fla_layout(states[first]), pool[first]))
        row.update({f"vllm_{name}_us": us, f"vllm_{name}_over_ours": us / ours_us,
                    f"vllm_{name}_copy_fraction": state_bytes / (us * 1e-6) / copy_bw,
                    f"vllm_{name}_max_rel_diff": diff})  # fmt: skip
    return row


# ---- prefill ---------------------------------------------------------------------------------


def bench_prefill(lengths: list[int], sweep: bool, fla: Any) -> dict[str, Any]:
    from unified_attn.backends.triton import gated_delta_ops as ops

    tokens, num = sum(lengths), len(lengths)
    inp = rule_inputs(tokens, seed=tokens)
    qsl = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                       device="cuda")  # fmt: skip
    zeros = torch.zeros(num, dtype=torch.int32, device="cuda")
    pool = torch.randn(2 * num + 1, HV, DK, DV, device="cuda") * 0.1
    reads = torch.arange(1, num + 1, dtype=torch.int32, device="cuda")  # read slots stay intact
    writes = reads + num
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], qsl, zeros, pool, reads, writes)

    def ours(kernel: str = "chunked") -> torch.Tensor:
        return ops.gated_delta_chunked_varlen(*args, SCALE, 64, l2norm=True, kernel=kernel)

    ours()  # compiles
    peers = {} if fla is None else prefill_peer_calls(fla, inp, qsl, pool[1 : num + 1])
    for peer in peers.values():
        peer()  # compiles
    warm_up_gpu()
    rounds = paired_ms({"ours": ours, **peers})
    row: dict[str, Any] = {"lengths": lengths, "rounds_ms": rounds,
                           "ours_ms": statistics.median(rounds["ours"])}  # fmt: skip
    row["tokens_per_s"] = tokens / (row["ours_ms"] * 1e-3)
    row["ours_wy_ms"] = gpu_ms(lambda: ops.wy_form(*args[:7], SCALE, True))
    row["tokens_ms"] = gpu_ms(lambda: ours("tokens"))
    o = ours().clone()
    final = pool[num + 1 :].clone()
    row["tokens_max_rel_diff"] = max(rel_diff(ours("tokens"), o), rel_diff(pool[num + 1 :], final))
    row["torch_ms"] = torch_ms(inp, lengths)
    row["torch_over_ours"] = row["torch_ms"] / row["ours_ms"]
    if sweep:
        row.update(chunked_sweep(ops, args, o))
    for name, peer in peers.items():
        ms = statistics.median(rounds[name])
        o_peer, final_peer = peer()
        diff = max(rel_diff(o_peer, o), rel_diff(fla_layout(final_peer), final))
        row.update({f"{name}_ms": ms, f"{name}_over_ours": ms / row["ours_ms"],
                    f"{name}_max_rel_diff": diff})  # fmt: skip
    return row


def chunked_sweep(ops: Any, args: tuple, o: torch.Tensor) -> dict[str, Any]:
    """ms of the chunked path at each state tile (BLOCK_V, warps, stages), with its output's
    difference from the default's."""
    out = torch.empty_like(o)
    times, diffs = {}, {}
    for tiles in CHUNKED_SWEEP:
        name = "x".join(map(str, tiles))
        times[name] = gpu_ms(lambda t=tiles: ops.launch_chunked(*args, None, out, SCALE, 64,
                                                                True, t))  # fmt: skip
        diffs[name] = rel_diff(out, o)
    best = min(times, key=times.__getitem__)
    return {"chunked_tiles_ms": times, "chunked_tiles_max_rel_diff": diffs,
            "best_chunked_tiles": best}  # fmt: skip


def prefill_peer_calls(
    fla: Any, inp: dict, qsl: torch.Tensor, initial: torch.Tensor
) -> dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
    """fla's prefill on the same raw q, k (`vllm`, the norm in its kernel) and on q, k
    normalised beforehand (`vllm_prenorm`, vLLM's own prefill, whose norm is fused earlier)."""
    from unified_attn.backends import gated_delta_math

    q, k = gated_delta_math.prepare_qk(inp["q"], inp["k"], HK)
    normed = {**inp, "q": (q / SCALE).to(DT), "k": k.to(DT)}
    sides = (("vllm", inp, True), ("vllm_prenorm", normed, False))
    return {name: fla_prefill(fla, peer_inp, qsl, fla_layout(initial), SCALE, l2norm)
            for name, peer_inp, l2norm in sides}  # fmt: skip


def torch_ms(inp: dict[str, torch.Tensor], lengths: list[int]) -> float:
    """The torch chunked form (`gated_delta_math.gated_delta_chunked`), request by request."""
    from unified_attn.backends import gated_delta_math

    q, k = gated_delta_math.prepare_qk(inp["q"], inp["k"], HV)
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    state = torch.zeros(HV, DK, DV, device="cuda")

    def run() -> None:
        for r in range(len(lengths)):
            rows = slice(starts[r], starts[r + 1])
            gated_delta_math.gated_delta_chunked(q[rows], k[rows], inp["v"][rows], inp["g"][rows],
                                                 inp["beta"][rows], state, 64)  # fmt: skip

    return gpu_ms(run)


# ---- main ------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    console = make_console(140)
    if not torch.cuda.is_available():
        raise SystemExit("gated_delta_kernels.py needs a CUDA GPU")
    out = output_dir(args)
    fla = load_fla()
    if fla is None:
        console.print("[yellow]no benchmarks/peers/vllm_fla: run vllm_peers.py first[/]")
    results: dict[str, Any] = run_header(SCHEMA, "gated_delta_kernels.py", args.quick, args.argv)
    results["shape"] = {"key_heads": HK, "value_heads": HV, "key_dim": DK, "value_dim": DV}
    results["vllm_peers"] = fla is not None
    results["copy_bandwidth_bytes_per_s"] = copy_bw = copy_bandwidth()
    batches = ([1, 64] if args.quick else DECODE_BATCHES) if "decode" in args.sections else []
    results["decode"] = [bench_decode(b, copy_bw, not args.quick, fla) for b in batches]
    write_json(out / "gated_delta_kernels.json", results)
    shapes = PREFILL[: 1 if args.quick else len(PREFILL)] if "prefill" in args.sections else []
    results["prefill"] = [bench_prefill(lengths, not args.quick, fla) for lengths in shapes]
    write_json(out / "gated_delta_kernels.json", results)
    report(console, results)
    console.print(f"wrote {out / 'gated_delta_kernels.json'}")


def _f(row: dict[str, Any], key: str, spec: str) -> str:
    return format(row[key], spec) if key in row else "-"


def report(console: Any, results: dict[str, Any]) -> None:
    t = table("decode update (us; vLLM/ours > 1: ours faster)",
              ["batch", "us", "copy frac", "best tiles", "best frac", "fused_recurrent",
               "vLLM/ours", "packed", "vLLM/ours", "max diff"])  # fmt: skip
    for r in results["decode"]:
        diffs = [r[k] for k in ("vllm_fused_recurrent_max_rel_diff", "vllm_packed_max_rel_diff")
                 if k in r]  # fmt: skip
        t.add_row(str(r["batch"]), _f(r, "ours_us", ".1f"), _f(r, "ours_copy_fraction", ".2f"),
                  r.get("best_tiles", "-"), _f(r, "best_copy_fraction", ".2f"),
                  _f(r, "vllm_fused_recurrent_us", ".1f"),
                  _f(r, "vllm_fused_recurrent_over_ours", ".2f"), _f(r, "vllm_packed_us", ".1f"),
                  _f(r, "vllm_packed_over_ours", ".2f"),
                  f"{max(diffs):.1e}" if diffs else "-")  # fmt: skip
    console.print(t)
    t = table("prefill (ms; vLLM/ours > 1: ours faster)",
              ["lengths", "chunked", "Mtok/s", "WY half", "best tiles", "tokens", "fla",
               "vLLM/ours", "fla prenorm", "vLLM/ours", "max diff", "torch"])  # fmt: skip
    for r in results["prefill"]:
        best = r.get("best_chunked_tiles")
        tiles = f"{best} {r['chunked_tiles_ms'][best]:.2f}" if best else "-"
        diffs = [r[k] for k in ("vllm_max_rel_diff", "vllm_prenorm_max_rel_diff",
                                "tokens_max_rel_diff") if k in r]  # fmt: skip
        t.add_row(str(r["lengths"]), _f(r, "ours_ms", ".2f"), f"{r['tokens_per_s'] / 1e6:.2f}",
                  _f(r, "ours_wy_ms", ".2f"), tiles, _f(r, "tokens_ms", ".2f"),
                  _f(r, "vllm_ms", ".2f"), _f(r, "vllm_over_ours", ".2f"),
                  _f(r, "vllm_prenorm_ms", ".2f"), _f(r, "vllm_prenorm_over_ours", ".2f"),
                  f"{max(diffs):.1e}", _f(r, "torch_ms", ".1f"))  # fmt: skip
    console.print(t)


if __name__ == "__main__":
    main()
