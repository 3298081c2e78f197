"""Mamba-2 state-layer kernels (`backends/triton/ssm_ops.py`) against vLLM 0.33's Triton
kernels as same-run peers, at Nemotron-H-8B and Granite-4.0-H-Small shapes (bfloat16).

    python benchmarks/vllm_peers.py /path/to/vllm-0.33.0-*.whl   # once, where vLLM is
    python benchmarks/ssm_kernels.py [--out DIR] [--quick] [--models nemotron_h_8b,...]

- decode state update (`ssd_state_update` vs `selective_state_update`), batch 1..256: a pool
  of float32 state blocks, read == write slot; each launch replayed from a CUDA graph that
  cycles over disjoint blocks (>= 256 MiB touched, so L2 does not serve the states). Reported:
  us per launch, state bytes read + written / time (TB/s) and as a fraction of the
  device-to-device copy bandwidth measured in this run (target >= 0.7); with `--tile-sweep`
  also our tile sweep.
- prefill chunked scan (`ssd_scan_varlen` vs `mamba_chunk_scan_combined_varlen`) at 2k and
  8k tokens, one request and four; `triton.testing.do_bench` medians, ours and vLLM's timed in
  turn three times (`common.paired_ms`; `rounds_ms` keeps each round), the median reported.
- conv: prefill (`causal_conv1d_varlen` vs `causal_conv1d_fn` with its metadata prepared as
  vLLM's builder does; timed as the scan) and decode (`causal_conv1d_update` vs vLLM's,
  graphs as above).

Every row has `vllm_over_ours` (time ratio: > 1 means we are faster) and `max_rel_diff` of
our outputs and states against vLLM's on the same inputs. Writes `DIR/ssm_kernels.json` (after
every section) and `DIR/ssm_kernels.png`. Without the peers folder only our kernels run.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from common import (
    add_out_argument,
    gpu_ms,
    make_console,
    output_dir,
    paired_ms,
    pyplot,
    run_header,
    save_figure,
    table,
    warm_up_gpu,
    write_json,
)
from ssm_peer_calls import vllm_chunks, vllm_conv_metadata, vllm_decode

SCHEMA = "unified_attn.benchmarks.ssm_kernels/v1"
# (heads, head_dim, groups, state_dim, conv width, chunk_size); from the HF configs
MODELS = {
    "nemotron_h_8b": (128, 64, 8, 128, 4, 128),
    "granite_4_h_small": (128, 64, 1, 128, 4, 256),
}
DECODE_BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
PREFILL = [[2048], [8192], [512] * 4, [2048] * 4]
SECTIONS = ("decode", "scan", "conv_prefill", "conv_decode")
TILE_SWEEP = [(bp, w) for bp in (4, 8, 16, 32) for w in (2, 4, 8)]
ROTATE_BYTES = 256 << 20
DT = torch.bfloat16


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_out_argument(ap)
    ap.add_argument("--quick", action="store_true", help="a few shapes, for a smoke run")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated model names")
    ap.add_argument("--tile-sweep", action="store_true", help="also time every decode tile")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated: any of {', '.join(SECTIONS)}")  # fmt: skip
    args = ap.parse_args(argv)
    args.sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    unknown = sorted(set(args.sections) - set(SECTIONS)) or ([] if args.sections else ["(none)"])
    if unknown:
        ap.error(f"--sections: expected any of {', '.join(SECTIONS)}, got {', '.join(unknown)}")
    args.argv = argv
    return args


def load_peers() -> SimpleNamespace | None:
    try:
        from peers.vllm_mamba import causal_conv1d, mamba_ssm, ssd_combined
    except ImportError:
        return None
    return SimpleNamespace(conv=causal_conv1d, ssu=mamba_ssm, scan=ssd_combined)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (gpu_ms(lambda: dst.copy_(src)) * 1e-3)


def graph_us(launches: list[Callable[[], Any]], replays: int = 20) -> float:
    """us per launch: all `launches` captured in one CUDA graph, replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in launches:  # warm up (compiles, autotunes) outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in launches:
            fn()
    for _ in range(3):  # first replays of a fresh graph run slower (up to 5% at 1 GB of state)
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * len(launches))


def rotations(bytes_per_launch: int) -> int:
    return max(1, min(64, math.ceil(ROTATE_BYTES / bytes_per_launch)))


# ---- decode ----------------------------------------------------------------------------------


def decode_inputs(model: tuple[int, ...], batch: int, blocks: int) -> dict[str, Any]:
    heads, head_dim, groups, state, _, _ = model
    g = torch.Generator(device="cuda").manual_seed(batch)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device="cuda") * scale

    return {
        "x": randn(batch, heads, head_dim).to(DT), "dt": randn(batch, heads, scale=0.5).to(DT),
        "dt_bias": randn(heads, scale=0.5) - 1, "A": -torch.rand(heads, device="cuda") - 0.1,
        "B": randn(batch, groups, state, scale=0.5).to(DT),
        "C": randn(batch, groups, state, scale=0.5).to(DT), "D": randn(heads),
        "pool": randn(blocks, heads, head_dim, state, scale=0.1),
    }  # fmt: skip


def bench_decode(
    model: tuple[int, ...], batch: int, peers: Any, copy_bw: float, tile_sweep: bool
) -> dict:
    from unified_attn.backends.triton import ssm_ops

    heads, head_dim, groups, state, _, _ = model
    state_bytes = 2 * batch * heads * head_dim * state * 4
    rot = rotations(state_bytes // 2)
    inp = decode_inputs(model, batch, 1 + rot * batch)  # block 0: vLLM's null block
    slot_sets = [torch.arange(1 + r * batch, 1 + (r + 1) * batch, dtype=torch.int32,
                              device="cuda") for r in range(rot)]  # fmt: skip
    args = [inp[k] for k in ("x", "dt", "dt_bias", "A", "B", "C", "D")]
    y = torch.empty_like(inp["x"])

    def ours(slots: torch.Tensor, tiles: tuple[int, int] | None = None) -> Callable[[], Any]:
        if tiles is None:
            return lambda: ssm_ops.ssd_state_update(*args, inp["pool"], slots, slots)
        return lambda: ssm_ops.launch_state_update(
            *args, inp["pool"], slots, slots, y, 0.0, math.inf, heads // groups, *tiles
        )

    row: dict[str, Any] = {"batch": batch, "state_bytes": state_bytes}
    row["ours_us"] = graph_us([ours(s) for s in slot_sets])
    row["ours_copy_fraction"] = state_bytes / (row["ours_us"] * 1e-6) / copy_bw
    if tile_sweep:
        sweep = {f"{bp}x{w}": graph_us([ours(s, (bp, w)) for s in slot_sets])
                 for bp, w in TILE_SWEEP}  # fmt: skip
        row["tile_sweep_us"] = sweep
        row["best_tiles"] = min(sweep, key=sweep.__getitem__)
        row["best_copy_fraction"] = state_bytes / (sweep[row["best_tiles"]] * 1e-6) / copy_bw
    if peers is not None:
        vllm = vllm_decode(peers, inp, head_dim, state)
        row["vllm_us"] = graph_us([lambda s=s: vllm(s) for s in slot_sets])
        row["vllm_copy_fraction"] = state_bytes / (row["vllm_us"] * 1e-6) / copy_bw
        row["vllm_over_ours"] = row["vllm_us"] / row["ours_us"]
        row["max_rel_diff"] = decode_diff(ssm_ops, vllm, inp, args, slot_sets[0])
    return row


def decode_diff(ops: Any, vllm: Callable, inp: dict, args: list, slots: torch.Tensor) -> float:
    pool = inp["pool"]
    before = pool[slots.long()].clone()
    y = ops.ssd_state_update(*args, pool, slots, slots)
    ours_states = pool[slots.long()].clone()
    pool[slots.long()] = before
    y_vllm = vllm(slots).clone()
    return max(rel_diff(y, y_vllm), rel_diff(ours_states, pool[slots.long()]))


# ---- prefill scan ----------------------------------------------------------------------------


def scan_inputs(model: tuple[int, ...], lengths: list[int]) -> dict[str, Any]:
    inp = decode_inputs(model, sum(lengths), len(lengths) + 1)
    qsl = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    inp.update(qsl=qsl.cuda(), qsl_cpu=qsl, offsets=torch.zeros(len(lengths), dtype=torch.int32,
               device="cuda"), slots=torch.arange(1, len(lengths) + 1, dtype=torch.int32,
               device="cuda"), none=torch.full((len(lengths),), -1, dtype=torch.int32,
               device="cuda"))  # fmt: skip
    return inp


def bench_scan(model: tuple[int, ...], lengths: list[int], peers: Any) -> dict:
    from unified_attn.backends.triton import ssm_ops

    chunk = model[5]
    inp = scan_inputs(model, lengths)
    args = [inp[k] for k in ("x", "dt", "dt_bias", "A", "B", "C", "D")]

    def ours() -> torch.Tensor:
        return ssm_ops.ssd_scan_varlen(*args, inp["qsl"], inp["offsets"], inp["pool"],
                                       inp["none"], inp["slots"], chunk)  # fmt: skip

    ours()  # compiles
    if peers is None:
        warm_up_gpu()
        return {"lengths": lengths, "ours_ms": gpu_ms(ours)}
    cu_chunks, seq_idx, last = vllm_chunks(lengths, chunk)
    out = torch.empty_like(inp["x"])

    def vllm() -> torch.Tensor:
        peers.scan.mamba_chunk_scan_combined_varlen(
            inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk, inp["qsl"], cu_chunks,
            last, seq_idx, out, D=inp["D"], dt_bias=inp["dt_bias"], dt_softplus=True,
            state_dtype=torch.float32, final_states_out=inp["pool"],
            final_state_indices=inp["slots"],
        )  # fmt: skip
        return out

    vllm()  # compiles
    row = paired_row(lengths, ours, vllm)
    y = ours().clone()
    states = inp["pool"][1:].clone()
    row["max_rel_diff"] = max(rel_diff(y, vllm()), rel_diff(states, inp["pool"][1:]))
    return row


# ---- conv ------------------------------------------------------------------------------------


def conv_inputs(model: tuple[int, ...], rows: int, blocks: int) -> dict[str, torch.Tensor]:
    heads, head_dim, groups, state, width, _ = model
    channels = heads * head_dim + 2 * groups * state
    return {"x": torch.randn(rows, channels, device="cuda").to(DT),
            "states": torch.randn(blocks, width - 1, channels, device="cuda").to(DT),
            "weight": (torch.randn(channels, width, device="cuda") / width).to(DT),
            "bias": torch.randn(channels, device="cuda").to(DT)}  # fmt: skip


def bench_conv_prefill(model: tuple[int, ...], lengths: list[int], peers: Any) -> dict:
    from unified_attn.backends.triton import ssm_ops

    qsl_cpu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    inp = conv_inputs(model, sum(lengths), len(lengths) + 1)
    qsl = qsl_cpu.cuda()
    slots = torch.arange(1, len(lengths) + 1, dtype=torch.int32, device="cuda")
    none = torch.full_like(slots, -1)

    def ours() -> torch.Tensor:
        return ssm_ops.causal_conv1d_varlen(inp["x"], qsl, inp["states"], none, slots,
                                            inp["weight"], inp["bias"])  # fmt: skip

    ours()  # compiles
    if peers is None:
        warm_up_gpu()
        return {"lengths": lengths, "ours_ms": gpu_ms(ours)}
    meta = vllm_conv_metadata(qsl_cpu)
    fresh = torch.zeros(len(lengths), dtype=torch.bool, device="cuda")

    def vllm() -> torch.Tensor:
        return peers.conv.causal_conv1d_fn(
            inp["x"].t(), inp["weight"], inp["bias"], inp["states"].transpose(1, 2), qsl,
            cache_indices=slots, has_initial_state=fresh, metadata=meta,
        ).t()  # fmt: skip

    vllm()  # compiles
    row = paired_row(lengths, ours, vllm)
    y = ours().clone()
    states = inp["states"][1:].clone()
    row["max_rel_diff"] = max(rel_diff(y, vllm()), rel_diff(states, inp["states"][1:]))
    return row


def paired_row(lengths: list[int], ours: Callable[[], Any], vllm: Callable[[], Any]) -> dict:
    """A prefill row: ours and vLLM's (both compiled) timed in turn (`common.paired_ms`) on a
    busy GPU, the medians and every round's time."""
    warm_up_gpu()
    rounds = paired_ms({"ours": ours, "vllm": vllm})
    row: dict[str, Any] = {"lengths": lengths, "rounds_ms": rounds}
    row["ours_ms"], row["vllm_ms"] = (statistics.median(rounds[k]) for k in ("ours", "vllm"))
    row["vllm_over_ours"] = row["vllm_ms"] / row["ours_ms"]
    return row


def bench_conv_decode(model: tuple[int, ...], batch: int, peers: Any) -> dict:
    from unified_attn.backends.triton import ssm_ops

    channels = conv_inputs(model, 1, 1)["x"].shape[1]
    rot = rotations(batch * channels * 2 * (model[4] - 1))
    inp = conv_inputs(model, batch, 1 + rot * batch)
    slot_sets = [torch.arange(1 + r * batch, 1 + (r + 1) * batch, dtype=torch.int32,
                              device="cuda") for r in range(rot)]  # fmt: skip
    conv_args = (inp["weight"], inp["bias"])
    row: dict[str, Any] = {"batch": batch}
    row["ours_us"] = graph_us([
        lambda s=s: ssm_ops.causal_conv1d_update(inp["x"], inp["states"], s, s, *conv_args)
        for s in slot_sets])  # fmt: skip
    if peers is not None:
        out = torch.empty_like(inp["x"])
        row["vllm_us"] = graph_us([
            lambda s=s: peers.conv.causal_conv1d_update(
                inp["x"], inp["states"].transpose(1, 2), *conv_args, activation="silu",
                conv_state_indices=s, out=out)
            for s in slot_sets])  # fmt: skip
        row["vllm_over_ours"] = row["vllm_us"] / row["ours_us"]
    return row


# ---- report ----------------------------------------------------------------------------------


def plot(results: dict[str, Any], path: Any, console: Any) -> None:
    plt = pyplot(console)
    if plt is None:
        return
    names = list(results["models"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in names:
        rows = results["models"][name]["decode"]
        if not rows:
            continue
        batches = [r["batch"] for r in rows]
        axes[0].plot(batches, [r["ours_copy_fraction"] for r in rows], "o-", label=f"{name} ours")
        if "vllm_copy_fraction" in rows[0]:
            axes[0].plot(batches, [r["vllm_copy_fraction"] for r in rows], "x--",
                         label=f"{name} vLLM")  # fmt: skip
    axes[0].axhline(0.7, color="grey", lw=0.8)
    axes[0].set(xscale="log", xlabel="decode batch", ylabel="state bytes / time / copy BW",
                title="decode state update")  # fmt: skip
    axes[0].legend(fontsize=7)
    labels, ratios = [], []
    for name in names:
        for section in ("scan", "conv_prefill", "conv_decode"):
            for r in results["models"][name][section]:
                if "vllm_over_ours" in r:
                    shape = r.get("batch", "+".join(map(str, r.get("lengths", []))))
                    labels.append(f"{name[:8]} {section} {shape}")
                    ratios.append(r["vllm_over_ours"])
    axes[1].barh(range(len(ratios)), ratios)
    axes[1].set_yticks(range(len(labels)), labels, fontsize=6)
    axes[1].axvline(1.0, color="grey", lw=0.8)
    axes[1].set(xlabel="vLLM time / our time (> 1: we are faster)", title="same-run ratios")
    save_figure(fig, path, dpi=120)


def run_section(
    section: str, model: tuple[int, ...], batches: list[int], prefills: list[list[int]],
    peers: SimpleNamespace | None, copy_bw: float, args: argparse.Namespace,
) -> list[dict[str, Any]]:  # fmt: skip
    """One section's rows for `model`."""
    if section == "decode":
        return [bench_decode(model, b, peers, copy_bw, args.tile_sweep) for b in batches]
    if section == "scan":
        return [bench_scan(model, lengths, peers) for lengths in prefills]
    if section == "conv_prefill":
        return [bench_conv_prefill(model, lengths, peers) for lengths in prefills]
    return [bench_conv_decode(model, b, peers) for b in batches]


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    console = make_console(120)
    if not torch.cuda.is_available():
        raise SystemExit("ssm_kernels.py needs a CUDA GPU")
    peers = load_peers()
    if peers is None:
        console.print("[yellow]no benchmarks/peers/vllm_mamba: run vllm_peers.py first[/]")
    out = output_dir(args)
    results: dict[str, Any] = run_header(SCHEMA, "ssm_kernels.py", args.quick, args.argv)
    results["copy_bandwidth_bytes_per_s"] = copy_bw = copy_bandwidth()
    results["vllm_peers"] = peers is not None
    results["models"] = {}
    batches = [1, 64] if args.quick else DECODE_BATCHES
    prefills = PREFILL[:1] if args.quick else PREFILL
    for name in args.models.split(","):
        model = MODELS[name]
        res: dict[str, Any] = {"shape": dict(zip(("heads", "head_dim", "groups", "state_dim",
                               "conv_width", "chunk_size"), model, strict=True))}  # fmt: skip
        results["models"][name] = res
        for section in SECTIONS:
            res[section] = (run_section(section, model, batches, prefills, peers, copy_bw, args)
                            if section in args.sections else [])  # fmt: skip
            write_json(out / "ssm_kernels.json", results)
        report(console, name, res)
    plot(results, out / "ssm_kernels.png", console)
    console.print(f"wrote {out / 'ssm_kernels.json'} and {out / 'ssm_kernels.png'}")


def report(console: Any, name: str, res: dict[str, Any]) -> None:
    t = table(f"{name}: decode state update", ["batch", "ours us", "copy frac", "best tiles",
              "best frac", "vLLM us", "vLLM frac", "vLLM/ours", "diff"])  # fmt: skip
    for r in res["decode"]:
        t.add_row(str(r["batch"]), f"{r['ours_us']:.1f}", f"{r['ours_copy_fraction']:.2f}",
                  r.get("best_tiles", "-"), f"{r.get('best_copy_fraction', float('nan')):.2f}",
                  *peer_cells(r, "us"),
                  f"{r.get('vllm_copy_fraction', float('nan')):.2f}",
                  f"{r.get('vllm_over_ours', float('nan')):.2f}",
                  f"{r.get('max_rel_diff', float('nan')):.1e}")  # fmt: skip
    console.print(t)
    for section, unit in (("scan", "ms"), ("conv_prefill", "ms"), ("conv_decode", "us")):
        t = table(f"{name}: {section}", ["shape", f"ours {unit}", f"vLLM {unit}", "vLLM/ours"])
        for r in res[section]:
            shape = str(r.get("batch", r.get("lengths")))
            t.add_row(shape, f"{r[f'ours_{unit}']:.3f}", *peer_cells(r, unit),
                      f"{r.get('vllm_over_ours', float('nan')):.2f}")  # fmt: skip
        console.print(t)


def peer_cells(row: dict[str, Any], unit: str) -> list[str]:
    return [f"{row[f'vllm_{unit}']:.3f}" if f"vllm_{unit}" in row else "-"]


if __name__ == "__main__":
    main()
