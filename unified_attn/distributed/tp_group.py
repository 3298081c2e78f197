"""Tensor parallelism on torch.distributed: one process per rank, rank 0 schedules.

`LLMEngine(model, tensor_parallel_size=N)` runs rank 0 in the caller's process and spawns ranks
1..N-1 (`TensorParallelGroup`); all join one process group (gloo on CPU, NCCL on CUDA: rank r
uses `cuda:r`), and a gloo control group carries the block agreement and the step messages,
which the other ranks wait for as long as the engine stays idle (`distributed/tp_process_group.py`).
Every rank builds the same model shard, plans and sizes its own KV cache from its own memory,
and the ranks agree on the minimum block count with one all-reduce (`distributed/tp_rank.py`). Each
step rank 0 broadcasts a compact `StepMessage` (`distributed/tp_messages.py`: new requests, new
tokens, the scheduled entries) and every rank runs its `ModelRunner` on it (`serve_rank`); the
row-parallel projections all-reduce inside the forward. Rank 0's sampled tokens are the ones
used; in overlapped steps (`engine/step_loop.py`) every rank samples the same ids on its device
and feeds them to its next step (`run_step`).

This module holds the ranks' processes: rank 0's side (`TensorParallelGroup`: spawning,
broadcasting, failure reports and shutdown) and the other ranks' serve loop, spawned
(`_rank_main`) or started by torchrun (`serve_launched_rank`). A rank that raises or dies makes
rank 0's next collective fail (or time out after `timeout_s()`); the engine then raises a
`RuntimeError` naming the rank and stops the others.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from unified_attn.distributed.tp_codec import decode, encode
from unified_attn.distributed.tp_messages import MESSAGE_BYTES, Mirror, Replica, StepMessage
from unified_attn.distributed.tp_process_group import (
    free_port,
    join_group,
    leave_group,
    startup_done,
    torchrun_rank,
)
from unified_attn.distributed.tp_rank import (
    agree_on_blocks,
    check_options,
    make_rank_runner,
    make_worker,
    rank_model,
)
from unified_attn.runner.gc_heap import freeze_if_configured
from unified_attn.runner.model_runner import ModelRunner
from unified_attn.runner.scheduler import SchedulerOutput

MAX_MESSAGE_SIZE = 1 << 30  # what a rank allocates for one message at most

# ---- ranks 1..N-1 ------------------------------------------------------------------------------


def serve_rank(config: Any, rank: int, world_size: int, port: int | None = None) -> None:
    """A rank other than 0: join the group, build the shard, agree on the block count, then
    run every step rank 0 broadcasts until it sends `None`."""
    if torch.device(config.device).type == "cpu":
        torch.set_num_threads(1)  # ranks share the host's cores
    control = join_group(config, rank, world_size, port)
    source = rank_model(config, rank, world_size)
    worker = make_worker(config, source, rank)
    num_blocks, _ = agree_on_blocks(worker, control)
    worker.allocate(num_blocks)
    runner = make_rank_runner(config, source, worker)
    startup_done(control)
    freeze_if_configured(config.freeze_gc)  # as rank 0's engine (runner/gc_heap.py)
    replica = Replica()
    while (message := receive_message(control)) is not None:  # as long as rank 0 is idle
        run_step(runner, replica.output(message), message.launch)
    runner.graphs = None


def run_step(runner: ModelRunner, output: SchedulerOutput, launch: bool) -> None:
    """One step on a rank other than 0, run as rank 0 runs it. Launched (overlapped): the rank
    samples the same ids as rank 0 (the same logits, generators in step) and keeps them on its
    device for the next step's inputs; nothing is copied to the host and the `PendingStep` is
    dropped. Plain: rank 0's tokens are used, this rank only makes the same random draws
    (`ModelRunner.execute(sample=False)`)."""
    if launch:
        runner.launch(output, to_host=False)
    else:
        runner.execute(output, sample=False)


def send_message(message: StepMessage | None, group: Any) -> None:
    """Rank 0: broadcast one step (or None: stop) on the control group, in one fixed-size
    collective of `MESSAGE_BYTES` (an 8-byte length, then the encoded message) when it fits,
    the rest in a second one: `broadcast_object_list` takes two collectives every time."""
    data = encode(message)
    head = min(len(data), MESSAGE_BYTES - 8)
    buffer = torch.empty(MESSAGE_BYTES, dtype=torch.uint8)
    buffer[:8].view(torch.int64)[0] = len(data)
    buffer[8 : 8 + head] = torch.frombuffer(bytearray(data[:head]), dtype=torch.uint8)
    dist.broadcast(buffer, src=0, group=group)
    if len(data) > head:
        rest = torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8)
        dist.broadcast(rest, src=0, group=group)


def receive_message(group: Any) -> StepMessage | None:
    """Ranks 1..N-1: the next message `send_message` broadcasts (`decode` refuses, with a
    `ValueError`, anything that is not a well-formed message)."""
    buffer = torch.empty(MESSAGE_BYTES, dtype=torch.uint8)
    dist.broadcast(buffer, src=0, group=group)
    size = int(buffer[:8].view(torch.int64)[0])
    if not 0 <= size <= MAX_MESSAGE_SIZE:
        raise ValueError(
            f"step message: length prefix {size}, expected 0 to {MAX_MESSAGE_SIZE} bytes"
        )
    head = min(size, MESSAGE_BYTES - 8)
    data = buffer[8 : 8 + head].numpy().tobytes()
    if size > head:
        rest = torch.empty(size - head, dtype=torch.uint8)
        dist.broadcast(rest, src=0, group=group)
        data += rest.numpy().tobytes()
    return decode(data)


def serve_launched_rank(config: Any) -> None:
    """Under torchrun, on a rank other than 0: serve rank 0's steps, then end the process
    (rank 0, which runs the caller's script, shuts the ranks down when its engine stops).
    Elsewhere: return at once."""
    rank = torchrun_rank(config)
    if rank is None or rank == 0:
        return
    check_options(config)
    serve_rank(config, rank, config.tensor_parallel_size)
    if leave_group():
        raise SystemExit(0)
    os._exit(0)  # a NCCL group that could not be left must not hold the process open


def _rank_main(config: Any, rank: int, world_size: int, port: int | None, errors: Any) -> None:
    """A spawned rank: serve, report a failure to rank 0, leave the group, end the process."""
    code = 0
    try:
        serve_rank(config, rank, world_size, port)
    except BaseException as error:  # report to rank 0, which names this rank
        errors.put((rank, f"{type(error).__name__}: {error}", traceback.format_exc(limit=4)))
        code = 1
    leave_group()
    # The process ends here: a NCCL group that could not be left must not hold it open.
    os._exit(code)


# ---- rank 0 ------------------------------------------------------------------------------------


# What a rank that dies before it serves most likely met: a script that builds the engine at
# its top level, which each spawned rank imports again.
UNGUARDED_SCRIPT = (
    "if the engine is built by a script, put that code under `if __name__ == \"__main__\":` "
    "(every rank is a spawned process that imports the script; unguarded, it builds another "
    "tensor-parallel engine there)"
)


class TensorParallelGroup:
    """Rank 0's side: the spawned ranks, the step broadcast, failure reports and shutdown."""

    def __init__(self, config: Any) -> None:
        check_options(config)
        if getattr(mp.current_process(), "_inheriting", False):  # a spawned rank starting
            raise RuntimeError(UNGUARDED_SCRIPT)
        if dist.is_initialized():
            raise ValueError(
                "tensor_parallel_size > 1: this process already belongs to a torch.distributed "
                "group (another tensor-parallel engine?); shut that engine down first, or on "
                "CUDA, whose group may not be left once graphs captured it, use a new process"
            )
        self.world_size = n = config.tensor_parallel_size
        # under torchrun the launcher started every rank; else spawn ranks 1..N-1 here
        launched = torchrun_rank(config) is not None
        port = None if launched else free_port()
        context = mp.get_context("spawn")
        self.errors = context.Queue()
        self.processes = [
            context.Process(
                target=_rank_main, args=(config, rank, n, port, self.errors), daemon=True
            )
            for rank in range(1, n)
            if not launched
        ]
        for process in self.processes:
            process.start()
        self.mirror = Mirror()
        self.closed = False
        self.left_group = False  # False after shutdown: this process cannot start another group
        self.control: Any = None
        try:
            self.control = join_group(config, 0, n, port)
        except BaseException as error:
            self.fail(error)

    def built(self) -> None:
        """Rank 0 has built; wait for every rank to have built too (`startup_done`)."""
        try:
            startup_done(self.control)
        except BaseException as error:
            self.fail(error)

    def broadcast(self, output: SchedulerOutput, launch: bool = False) -> None:
        """Send one step to the other ranks (they run it as rank 0 does: launched, overlapped,
        or plainly)."""
        self._send(self.mirror.message(output, launch))

    def _send(self, message: StepMessage | None) -> None:
        send_message(message, self.control)

    def fail(self, error: BaseException) -> None:
        """Stop every rank, then raise: a `RuntimeError` naming the rank that failed (its
        report, or how it died), or rank 0's own `ValueError` unchanged when no other rank
        failed (a bad option found while building, which the caller reports as such)."""
        failed = self._failed_rank()
        self.shutdown(graceful=False)
        if failed is None and isinstance(error, ValueError):
            raise error
        reason = failed or f"a collective failed: {error}"
        raise RuntimeError(f"tensor parallelism: {reason}") from error

    def _failed_rank(self) -> str | None:
        try:
            rank, message, _trace = self.errors.get(timeout=1.0)
            return f"rank {rank} raised {message}"
        except queue.Empty:
            pass
        for rank, process in enumerate(self.processes, start=1):
            process.join(timeout=0.1)
            if process.exitcode is not None:
                return f"rank {rank} died (exit code {process.exitcode}); {UNGUARDED_SCRIPT}"
        return None

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the other ranks (a `None` step when they are healthy, else terminate them) and
        leave the process group. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if graceful and dist.is_initialized():
            try:
                self._send(None)
            except Exception:  # a rank is gone: terminate below
                graceful = False
        if graceful:  # the ranks leave the group as they stop; NCCL's teardown waits for all
            self.left_group = leave_group()
        for process in self.processes:
            process.join(timeout=10 if graceful else 0.5)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
        if not graceful:  # after a failure: the peers are gone, never wait on them for long
            self.left_group = leave_group()

    @property
    def pids(self) -> Sequence[int | None]:
        return [p.pid for p in self.processes]
