"""Tile sweep of the Mamba-2 convolution kernels (`kernels/ssm/conv1d.py`) on one GPU, bfloat16,
Nemotron-H-8B's channels (10,240, 4 taps): the varlen prefill kernel at 2k / 8k tokens (one
request), 4 x 2k and 4 x 512, and the one-token update at batch 1 .. 256 (CUDA-graph replays).
Prints the time of every tile and the best per shape; `backends/triton/ssm_ops.py` takes the
winners as its defaults.

    python benchmarks/tune_ssm_conv.py
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.testing

from unified_attn.backends.triton import ssm_ops
from unified_attn.kernels.pdl import pdl_enabled
from unified_attn.kernels.ssm import conv1d

CHANNELS, WIDTH, BLOCKS = 10240, 4, 512


def prefill_args(lens: list[int]) -> tuple:
    dev = "cuda"
    x = torch.randn(sum(lens), CHANNELS, dtype=torch.bfloat16, device=dev)
    y = torch.empty_like(x)
    qsl = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=dev)
    states = torch.randn(BLOCKS, WIDTH - 1, CHANNELS, dtype=torch.bfloat16, device=dev)
    reads = torch.arange(len(lens), dtype=torch.int32, device=dev)
    weight = torch.randn(CHANNELS, WIDTH, dtype=torch.bfloat16, device=dev)
    return x, y, qsl, states, reads, weight


def time_prefill(lens: list[int], block_t: int, block_c: int, warps: int) -> float:
    x, y, qsl, states, reads, weight = prefill_args(lens)
    grid = (triton.cdiv(x.shape[0], block_t), triton.cdiv(CHANNELS, block_c))

    def launch() -> None:
        conv1d.causal_conv1d_varlen_kernel[grid](
            x, y, qsl, states, reads, weight, weight, x.shape[0], len(lens), CHANNELS,
            x.stride(0), y.stride(0), states.stride(0), states.stride(1), weight.stride(0),
            weight.stride(1), KERNEL_WIDTH=WIDTH, HAS_BIAS=True,
            SEARCH_STEPS=len(lens).bit_length(), BLOCK_T=block_t, BLOCK_C=block_c,
            num_warps=warps,
        )  # fmt: skip

    return float(triton.testing.do_bench(launch, warmup=10, rep=50)) * 1e3  # us


def time_update(batch: int, block_c: int, warps: int) -> float:
    dev = "cuda"
    x = torch.randn(batch, CHANNELS, dtype=torch.bfloat16, device=dev)
    y = torch.empty_like(x)
    states = torch.randn(BLOCKS, WIDTH - 1, CHANNELS, dtype=torch.bfloat16, device=dev)
    slots = torch.randperm(BLOCKS, device=dev)[:batch].int()
    weight = torch.randn(CHANNELS, WIDTH, dtype=torch.bfloat16, device=dev)
    grid = (batch, triton.cdiv(CHANNELS, block_c))

    def launch() -> None:
        conv1d.causal_conv1d_update_kernel[grid](
            x, y, states, slots, slots, weight, weight, CHANNELS, x.stride(0), y.stride(0),
            states.stride(0), states.stride(1), weight.stride(0), weight.stride(1),
            KERNEL_WIDTH=WIDTH, STATE_ROWS=4, HAS_BIAS=True, BLOCK_C=block_c, num_warps=warps,
            launch_pdl=pdl_enabled(x.device),
        )  # fmt: skip

    launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            launch()
    return float(triton.testing.do_bench(graph.replay, warmup=5, rep=50)) * 1e3 / 20


def main() -> None:
    default = (ssm_ops.CONV_BLOCK_T, ssm_ops.CONV_BLOCK_C, ssm_ops.CONV_WARPS)
    print("prefill: lens, BLOCK_T, BLOCK_C, warps -> us")
    for lens in ([2048], [8192], [2048] * 4, [512] * 4):
        results = {
            (t, c, w): time_prefill(lens, t, c, w)
            for t, c, w in itertools.product((8, 16, 32), (64, 128, 256, 512), (1, 2, 4, 8))
            if 512 <= t * c <= 16384
        }
        ranked = sorted(results, key=results.__getitem__)[:4]
        print(lens, "default", default, round(results[default], 1), "best",
              [(t, round(results[t], 1)) for t in ranked])  # fmt: skip
    print("update: batch, BLOCK_C, warps -> us")
    for batch in (1, 2, 4, 8, 16, 64, 256):
        results = {(c, w): time_update(batch, c, w)
                   for c, w in itertools.product((128, 256, 512, 1024), (1, 2, 4, 8))}
        ranked = sorted(results, key=results.__getitem__)[:4]
        now = ssm_ops.conv_update_tiles(batch)
        print(batch, "default", now, round(results[now], 2), "best",
              [(t, round(results[t], 2)) for t in ranked])  # fmt: skip


if __name__ == "__main__":
    main()
