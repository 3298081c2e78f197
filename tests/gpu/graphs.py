"""CUDA-graph capture for the GPU tests."""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture(step: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """Run `step` once on a side stream (compiles and warms up outside the capture), then
    capture one call of it in a graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def assert_replay_equals_eager(graph: torch.cuda.CUDAGraph, step: Callable[[], object],
                               out: torch.Tensor, what: object) -> None:  # fmt: skip
    """Replay `graph`, then run `step` eagerly: `out` must be bit-identical both times."""
    graph.replay()
    replayed = out.clone()
    step()
    assert torch.equal(replayed, out), f"replay differs from eager for {what}"
