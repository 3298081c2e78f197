"""What `model_step.py` measures on the device itself: the ceilings of the roofline (copy
bandwidth, matmul rate), a timer for one engine step, and the replay of a captured decode graph
alone, on every tensor-parallel rank at once.

Replaying one rank's graph alone would hang in its first all-reduce, so rank 0 broadcasts a
sentinel step (`replay_output`: no scheduled request, one `finished_ids` entry naming the batch
and the count) and every other rank's `ModelRunner.execute`, wrapped by `install_peer_replay`,
replays the same graph as many times instead of running a step. The spawned ranks import the
script again, so `model_step.py` installs the wrapper at import when it runs as a script
(`__main__` on rank 0, `__mp_main__` on the others).
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import gpu_ms

from unified_attn.runner.model_runner import ModelRunner
from unified_attn.runner.scheduler import SchedulerOutput
from unified_attn.runner.step_inputs import StepResult

REPLAY_ID = "model-step-replay"  # the sentinel's finished id: f"{REPLAY_ID}:{batch}:{count}"
WARMUP_REPLAYS = 3  # untimed replays first: the ranks start them at different host times
SCRIPT_NAME = "model_step.py"


# ---- ceilings -----------------------------------------------------------------------------------


def median_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Median ms per call: `triton.testing.do_bench` on CUDA, else 5 timed calls after one."""
    if device.type == "cuda":
        return gpu_ms(fn)
    fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy of 1 GiB (16 MiB on CPU): bytes read + written per second."""
    size = (1 << 30) if device.type == "cuda" else (1 << 24)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * size / (median_ms(lambda: dst.copy_(src), device) * 1e-3)


def matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of one large `torch.matmul` (8192^3 on CUDA, 512^3 on CPU) in `dtype`."""
    n = 8192 if device.type == "cuda" else 512
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    return 2 * n**3 / (median_ms(lambda: torch.matmul(a, b), device) * 1e-3)


def probe(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Both ceilings, measured before the engine takes the memory; frees what they used."""
    probes = {"copy_bytes_per_s": copy_bandwidth(device),
              "matmul_flops_per_s": matmul_rate(device, dtype)}  # fmt: skip
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return probes


def step_ms(step: Callable[[], Any], device: torch.device) -> float:
    """ms of one call of `step`: CUDA events around it on the current stream (the step's host
    work included, as the device waits for it), else the wall clock."""
    if device.type != "cuda":
        start_s = time.perf_counter()
        step()
        return 1e3 * (time.perf_counter() - start_s)
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    start.record()
    step()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end))


# ---- decode graph replays -----------------------------------------------------------------------


def replay_ms(graphs: Any, batch: int, count: int) -> float:
    """ms per replay of the decode graph `graphs` captured for `batch` requests (one token
    each), `count` replays back to back after `WARMUP_REPLAYS`, timed with CUDA events. The
    graph replays over the persistent buffers of the last step staged: the same inputs again,
    the same cache slots written."""
    graph = graphs.graphs[graphs.bucket(batch), 1]
    for _ in range(WARMUP_REPLAYS):
        graph.replay()
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    start.record()
    for _ in range(count):
        graph.replay()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / count


def replay_output(batch: int, count: int) -> SchedulerOutput:
    return SchedulerOutput([], [], [f"{REPLAY_ID}:{batch}:{count}"])


def replay_request(output: SchedulerOutput) -> tuple[int, int] | None:
    """(batch, count) of a sentinel step, else None."""
    if output.scheduled or len(output.finished_ids) != 1:
        return None
    name, *fields = output.finished_ids[0].split(":")
    return (int(fields[0]), int(fields[1])) if name == REPLAY_ID and len(fields) == 2 else None


def install_peer_replay() -> None:
    """Wrap `ModelRunner.execute` in this process: a sentinel step replays the decode graph
    (`replay_ms`), any other step runs as before."""
    original = ModelRunner.execute
    if getattr(original, "replays_sentinel", False):
        return

    @functools.wraps(original)
    def execute(self: ModelRunner, output: SchedulerOutput, sample: bool = True) -> StepResult:
        request = replay_request(output)
        if request is None:
            return original(self, output, sample)
        replay_ms(self.graphs, *request)
        return StepResult()

    execute.replays_sentinel = True  # type: ignore[attr-defined]
    ModelRunner.execute = execute


def peers_replay() -> bool:
    """Whether this process runs `model_step.py` as its script, so that the ranks it spawns
    import it again and install the wrapper."""
    main = sys.modules.get("__main__")
    return Path(getattr(main, "__file__", "") or "").name == SCRIPT_NAME


def device_step_ms(engine: Any, batch: int, count: int) -> float | None:
    """The decode graph of `batch` replayed alone on every rank: ms per replay on rank 0; None
    without graphs (CPU, `cuda_graphs=False`) or when the other ranks cannot replay it."""
    graphs = engine.runner.graphs
    if graphs is None or graphs.bucket(batch) is None:
        return None
    tp = engine._tp  # the ranks' group (None on one device)
    if tp is not None:
        if not peers_replay():
            return None
        tp.broadcast(replay_output(batch, count))
    return replay_ms(graphs, batch, count)
