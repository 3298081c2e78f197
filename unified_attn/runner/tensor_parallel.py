"""Tensor parallelism on torch.distributed: one process per rank, rank 0 schedules.

`LLMEngine(model, tensor_parallel_size=N)` runs rank 0 in the caller's process and spawns ranks
1..N-1 (`TensorParallelGroup`); all join one process group (gloo on CPU, NCCL on CUDA: rank r
uses `cuda:r`), and a gloo control group carries the block agreement and the step messages.
Every rank builds the same model shard (`rank_model`: the full model cut by
`models/tensor_parallel.py`), plans and sizes its own KV cache from its own memory, and the
ranks agree on the minimum block count with one all-reduce (`agree_on_blocks`). Each step rank 0
broadcasts a compact `StepMessage` (new requests, new tokens, the scheduled entries) and every
rank runs its `ModelRunner` on it; the row-parallel projections all-reduce inside the forward.
Only rank 0's sampled tokens are used.

A rank that raises or dies makes rank 0's next collective fail (or time out after
`TIMEOUT_S`); the engine then raises a `RuntimeError` naming the rank and stops the others.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import threading
import traceback
from collections.abc import Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist

from unified_attn.models.config import ModelConfig
from unified_attn.models.tensor_parallel import check_tensor_parallel, shard_decoder
from unified_attn.request import Request
from unified_attn.runner.memory import parse_memory
from unified_attn.runner.model_runner import ModelRunner
from unified_attn.runner.model_source import (
    ModelSource,
    default_dtype,
    load_model,
    model_config,
    select_engine_backend,
    selector_configs,
)
from unified_attn.runner.scheduler import ScheduledRequest, SchedulerOutput
from unified_attn.runner.worker import Worker
from unified_attn.tensor_specs import as_dtype

TIMEOUT_S = 30  # a collective waiting this long on a silent rank fails


# ---- what rank 0 sends each step ---------------------------------------------------------------


@attrs.frozen
class NewRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any


@attrs.frozen
class Entry:
    """A `ScheduledRequest` without its request."""

    request_id: str
    num_new_tokens: int
    num_computed_before: int
    block_ids: tuple[list[int], ...]
    is_new: bool
    will_sample: bool
    spec_token_ids: tuple[int, ...]


@attrs.frozen
class StepMessage:
    new: list[NewRequest]
    tokens: dict[str, list[int]]  # tokens to append to a request's copy
    entries: list[Entry]
    preempted_ids: list[str]
    finished_ids: list[str]


class Mirror:
    """Rank 0's record of the tokens each other rank holds, to send only what is new."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}

    def message(self, output: SchedulerOutput) -> StepMessage:
        preempted = [r.request_id for r in output.preempted]
        for rid in output.finished_ids:
            if rid not in preempted:
                self.sent.pop(rid, None)
        new, tokens, entries = [], {}, []
        for s in output.scheduled:
            request, rid = s.request, s.request.request_id
            if rid not in self.sent:
                new.append(NewRequest(rid, request.prompt_token_ids, request.sampling_params))
                self.sent[rid] = request.num_prompt_tokens
            if request.num_tokens > self.sent[rid]:
                tokens[rid] = request.all_token_ids[self.sent[rid] :]
                self.sent[rid] = request.num_tokens
            entries.append(
                Entry(
                    rid,
                    s.num_new_tokens,
                    s.num_computed_before,
                    s.block_ids,
                    s.is_new,
                    s.will_sample,
                    s.spec_token_ids,
                )
            )
        return StepMessage(new, tokens, entries, preempted, list(output.finished_ids))


class Replica:
    """A rank's copies of the requests, rebuilt into `SchedulerOutput`s from messages."""

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}

    def output(self, message: StepMessage) -> SchedulerOutput:
        for rid in message.finished_ids:
            if rid not in message.preempted_ids:
                self.requests.pop(rid, None)
        for new in message.new:
            self.requests[new.request_id] = Request(
                new.request_id, new.prompt_token_ids, sampling_params=new.sampling_params
            )
        for rid, tokens in message.tokens.items():
            self.requests[rid].append_output_token_ids(tokens)
        scheduled = [
            ScheduledRequest(
                self.requests[e.request_id],
                e.num_new_tokens,
                e.num_computed_before,
                e.block_ids,
                e.is_new,
                e.will_sample,
                e.spec_token_ids,
            )
            for e in message.entries
        ]
        preempted = [self.requests[rid] for rid in message.preempted_ids if rid in self.requests]
        return SchedulerOutput(scheduled, preempted, message.finished_ids)


# ---- building a rank ---------------------------------------------------------------------------


def check_options(config: Any) -> None:
    """Refuse, before any process starts, what `tensor_parallel_size` cannot serve."""
    n = config.tensor_parallel_size
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {n!r}")
    if n == 1:
        return
    model = model_config(config.model)
    if not isinstance(model, ModelConfig):
        raise ValueError(
            f"tensor_parallel_size={n}: {config.model!r} is a {type(model).__name__} model; "
            "tensor parallelism serves the Llama-family decoders (not encoder models or "
            "DeepSeek MLA yet); run it on one device"
        )
    check_tensor_parallel(model, n)
    if config.speculative_method is not None:
        raise ValueError(
            f"tensor_parallel_size={n} with speculative_method={config.speculative_method!r} "
            "is not supported yet; drop one of them"
        )
    device = torch.device(config.device)
    if device.type == "cuda" and torch.cuda.device_count() < n:
        raise ValueError(
            f"tensor_parallel_size={n} needs {n} CUDA devices, this machine has "
            f"{torch.cuda.device_count()}; lower tensor_parallel_size"
        )
    memory = config.kv_cache_memory
    if isinstance(memory, (list, tuple)) and len(memory) != n:
        raise ValueError(
            f"kv_cache_memory has {len(memory)} entries for tensor_parallel_size={n}; give one "
            "budget, or one per rank"
        )


def rank_device(config: Any, rank: int) -> torch.device:
    """`config.device`; with several ranks on CUDA, rank r's device is `cuda:r` (under
    torchrun: `cuda:LOCAL_RANK`, the rank's index on its node)."""
    device = torch.device(config.device)
    if device.type == "cuda" and config.tensor_parallel_size > 1:
        launched = torchrun_rank(config)
        return torch.device("cuda", local_rank() if launched is not None else rank)
    return device


# ---- torchrun ----------------------------------------------------------------------------------

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def torchrun_rank(config: Any) -> int | None:
    """This process's rank when `torchrun` (or another launcher setting its variables) started
    it and the engine is tensor-parallel, else None. The launcher's world must be the engine's
    `tensor_parallel_size`."""
    if config.tensor_parallel_size == 1 or not all(v in os.environ for v in TORCHRUN_VARIABLES):
        return None
    world = int(os.environ["WORLD_SIZE"])
    if world != config.tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size={config.tensor_parallel_size} but the launcher started "
            f"WORLD_SIZE={world} processes; start as many processes as ranks (torchrun "
            "--nnodes x --nproc-per-node = tensor_parallel_size)"
        )
    return int(os.environ["RANK"])


def local_rank() -> int:
    return int(os.environ["LOCAL_RANK"])


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


def rank_memory(config: Any, rank: int) -> int | None:
    """This rank's KV budget: `kv_cache_memory`, or its entry `rank` when it is a list."""
    memory = config.kv_cache_memory
    if isinstance(memory, (list, tuple)):
        memory = memory[rank]
    return None if memory is None else parse_memory(memory)


def rank_model(config: Any, rank: int, world_size: int) -> ModelSource:
    """Rank `rank`'s model: the full model loaded in host memory (so a model larger than one
    device can be split), cut to its shard on the rank's device."""
    device = rank_device(config, rank)
    on_device = attrs.evolve(config, device=str(device))
    if world_size == 1:
        return load_model(on_device)
    dtype = as_dtype(config.dtype) if config.dtype else default_dtype(device)
    source = load_model(
        attrs.evolve(on_device, device="cpu", dtype=str(dtype).removeprefix("torch."))
    )
    backend_cls = select_engine_backend(
        selector_configs(model_config(config.model), dtype, on_device), config.backend
    )
    options = {"batch_invariant": True} if config.batch_invariant else {}
    model = shard_decoder(
        source.model,
        rank,
        world_size,
        _all_reduce,
        _all_gather,
        backend_cls,
        device=device,
        backend_options=options,
    )
    return attrs.evolve(source, model=model, backend_cls=backend_cls)


def _all_reduce(tensor: torch.Tensor) -> None:
    dist.all_reduce(tensor)


def _all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """`[..., n]` on every rank -> `[..., world_size * n]`, the ranks' parts in rank order."""
    world = dist.get_world_size()
    parts = torch.empty((world, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
    if dist.get_backend() == "nccl":
        dist.all_gather_into_tensor(parts, tensor.contiguous())
    else:
        dist.all_gather(list(parts.unbind(0)), tensor.contiguous())
    return torch.cat(parts.unbind(0), dim=-1)


def agree_on_blocks(worker: Worker, control: Any) -> tuple[int, list[int]]:
    """Every rank sizes its own cache; all use the minimum (one all-reduce on the `control`
    group). Returns it and every rank's own figure."""
    own = worker.determine_num_blocks()
    counts = torch.zeros(dist.get_world_size(), dtype=torch.int64)
    counts[dist.get_rank()] = own
    dist.all_reduce(counts, group=control)
    per_rank = [int(c) for c in counts.tolist()]
    return min(per_rank), per_rank


def make_rank_runner(
    config: Any, source: ModelSource, worker: Worker, graph_query_lens: tuple[int, ...] = (1,)
) -> ModelRunner:
    """A rank's model runner (rank 0's is the engine's), with `config`'s settings."""
    return ModelRunner(
        source.model,
        worker.plan,
        device=worker.device,
        max_num_seqs=config.max_num_seqs,
        max_model_len=source.max_model_len,
        seed=config.seed,
        cuda_graphs=config.cuda_graphs,
        eos_token_ids=source.eos_token_ids,
        graph_query_lens=graph_query_lens,
    )


def make_worker(config: Any, source: ModelSource, rank: int) -> Worker:
    return Worker(
        source.model,
        device=rank_device(config, rank),
        max_model_len=source.max_model_len,
        max_in_flight_tokens=min(config.max_num_batched_tokens, source.max_model_len),
        block_size=config.block_size,
        kv_cache_memory=rank_memory(config, rank),
        gpu_memory_utilization=config.gpu_memory_utilization,
    )


# ---- the processes -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _join_group(config: Any, rank: int, world_size: int, port: int | None) -> Any:
    """Join the ranks' group (NCCL on CUDA, for the model's all-reduces, else gloo) and return
    the control group: gloo, for the block agreement and the step messages. Gloo notices a
    dead peer (its connections close) and honours the timeout, where a NCCL collective would
    wait for it forever; and small host messages need no device copies."""
    cuda = torch.device(config.device).type == "cuda"
    if cuda:
        torch.cuda.set_device(rank_device(config, rank))
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        # spawned ranks meet on this host; torchrun's ranks at its MASTER_ADDR:MASTER_PORT
        init_method="env://" if port is None else f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    return dist.new_group(backend="gloo", timeout=timeout) if cuda else dist.group.WORLD


def serve_rank(config: Any, rank: int, world_size: int, port: int | None = None) -> None:
    """A rank other than 0: join the group, build the shard, agree on the block count, then
    run every step rank 0 broadcasts until it sends `None`."""
    if torch.device(config.device).type == "cpu":
        torch.set_num_threads(1)  # ranks share the host's cores
    control = _join_group(config, rank, world_size, port)
    source = rank_model(config, rank, world_size)
    worker = make_worker(config, source, rank)
    num_blocks, _ = agree_on_blocks(worker, control)
    worker.allocate(num_blocks)
    runner = make_rank_runner(config, source, worker)
    replica = Replica()
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        if box[0] is None:
            break
        runner.execute(replica.output(box[0]), sample=False)  # rank 0 samples
    runner.graphs = None


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


def leave_group(timeout_s: float = 10.0) -> bool:
    """Leave the process group, bounded. NCCL's orderly teardown (`destroy_process_group`
    flushes the communicators) can wait forever once CUDA graphs captured its collectives
    (pytorch/pytorch#115388) or a peer died, so on NCCL, once the device is synchronised (no
    collective in flight), the communicators are aborted instead, which returns at once and
    forgets the groups as destroy does. It runs in a helper thread on this rank's device. True
    when the group was left."""
    if not dist.is_initialized():
        return True
    device = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        device = torch.cuda.current_device()

    nccl = dist.get_backend() == "nccl"

    def leave() -> None:
        if device is not None:
            torch.cuda.set_device(device)  # the thread's device is 0 otherwise
        if nccl:
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()

    thread = threading.Thread(target=leave, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive()


class TensorParallelGroup:
    """Rank 0's side: the spawned ranks, the step broadcast, failure reports and shutdown."""

    def __init__(self, config: Any) -> None:
        check_options(config)
        if dist.is_initialized():
            raise ValueError(
                "tensor_parallel_size > 1: this process already belongs to a torch.distributed "
                "group (another tensor-parallel engine?); shut that engine down first, or on "
                "CUDA, whose group may not be left once graphs captured it, use a new process"
            )
        self.world_size = n = config.tensor_parallel_size
        # under torchrun the launcher started every rank; else spawn ranks 1..N-1 here
        launched = torchrun_rank(config) is not None
        port = None if launched else _free_port()
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
            self.control = _join_group(config, 0, n, port)
        except BaseException as error:
            self.fail(error)

    def broadcast(self, output: SchedulerOutput) -> None:
        """Send one step to the other ranks (they run it as rank 0 does)."""
        self._send(self.mirror.message(output))

    def _send(self, message: StepMessage | None) -> None:
        dist.broadcast_object_list([message], src=0, group=self.control)

    def fail(self, error: BaseException) -> None:
        """Raise a `RuntimeError` naming the rank that failed (its report, or how it died),
        after stopping every rank."""
        reason = self._failed_rank() or f"a collective failed: {error}"
        self.shutdown(graceful=False)
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
                return f"rank {rank} died (exit code {process.exitcode})"
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
