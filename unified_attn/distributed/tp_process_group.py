"""A tensor-parallel rank's membership of the torch.distributed process group.

Who launched the ranks (`torchrun_rank`: a launcher such as torchrun set its variables, or the
engine spawns them itself), which device a rank uses (`rank_device`), where spawned ranks meet
(`free_port`), joining the group (`join_group`: NCCL or gloo for the model, gloo for control)
and leaving it, bounded even where NCCL's orderly teardown would hang (`leave_group`). The
model's collectives fail after `timeout_s()` (30 s, or the environment's
`UNIFIED_ATTN_TP_TIMEOUT_S`) of waiting on a silent rank once every rank has built
(`startup_done`); until then they wait up to `startup_timeout_s()` (600 s, or
`UNIFIED_ATTN_TP_STARTUP_TIMEOUT_S`), since ranks compile kernels and capture CUDA graphs at
different speeds and the first all-reduces of a warm-up or capture meet only when the slowest
rank gets there. The control group's waits (the block agreement, the step messages) last up to
`IDLE_LIMIT`, so ranks may load a model at different speeds and an engine may sit idle between
steps, while a dead peer still ends any wait at once (its connections close).
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
from typing import Any

import torch
import torch.distributed as dist

TIMEOUT_S = 30.0  # a collective waiting this long on a silent rank fails (default)
TIMEOUT_VARIABLE = "UNIFIED_ATTN_TP_TIMEOUT_S"
STARTUP_TIMEOUT_S = 600.0  # ... while the ranks build (load, compile, capture)
STARTUP_TIMEOUT_VARIABLE = "UNIFIED_ATTN_TP_STARTUP_TIMEOUT_S"
IDLE_LIMIT = datetime.timedelta(days=365)  # the control group's waits: startup, idle engines


def timeout_s() -> float:
    """Seconds a collective waits on a silent rank once the ranks have built:
    `UNIFIED_ATTN_TP_TIMEOUT_S` if set (spawned ranks inherit it), else `TIMEOUT_S`."""
    return _seconds(TIMEOUT_VARIABLE, TIMEOUT_S)


def startup_timeout_s() -> float:
    """Seconds a collective waits while the ranks build: `UNIFIED_ATTN_TP_STARTUP_TIMEOUT_S` if
    set, else `STARTUP_TIMEOUT_S`."""
    return _seconds(STARTUP_TIMEOUT_VARIABLE, STARTUP_TIMEOUT_S)


def _seconds(variable: str, default: float) -> float:
    text = os.environ.get(variable)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ValueError(
            f"{variable}={text!r}: expected a positive number of seconds; unset it for the "
            f"default {default:g}"
        )
    return value

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


# ---- torchrun ----------------------------------------------------------------------------------


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


def rank_device(config: Any, rank: int) -> torch.device:
    """`config.device`; with several ranks on CUDA, rank r's device is `cuda:r` (under
    torchrun: `cuda:LOCAL_RANK`, the rank's index on its node)."""
    device = torch.device(config.device)
    if device.type == "cuda" and config.tensor_parallel_size > 1:
        launched = torchrun_rank(config)
        return torch.device("cuda", local_rank() if launched is not None else rank)
    return device


# ---- joining and leaving -----------------------------------------------------------------------


def free_port() -> int:
    """A free TCP port on this host, where spawned ranks meet."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def join_group(config: Any, rank: int, world_size: int, port: int | None) -> Any:
    """Join the ranks' group (NCCL on CUDA, for the model's all-reduces, else gloo; meeting
    and, after `startup_done`, its collectives fail after `timeout_s()`, until then after
    `startup_timeout_s()`) and return the control group: gloo, for the block agreement and the
    step messages, waited on for up to `IDLE_LIMIT`, since ranks may load a large model at
    different speeds and an engine may sit idle between steps. Gloo notices a dead peer (its
    connections close) whatever the timeout, where a NCCL collective would wait for it forever;
    and small host messages need no device copies. `port` None: meet at the launcher's
    `MASTER_ADDR:MASTER_PORT` (torchrun), else on this host at `port`."""
    cuda = torch.device(config.device).type == "cuda"
    if cuda:
        torch.cuda.set_device(rank_device(config, rank))
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        # spawned ranks meet on this host; torchrun's ranks at its MASTER_ADDR:MASTER_PORT
        init_method="env://" if port is None else f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s()),  # meeting: ranks join first thing
    )
    _set_timeout(startup_timeout_s())  # then load, compile and capture at their own speeds
    return dist.new_group(backend="gloo", timeout=IDLE_LIMIT)


def _set_timeout(seconds: float) -> None:
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds))


def startup_done(control: Any) -> None:
    """Every rank has built its shard, cache and graphs (a barrier on the `control` group, which
    a dead rank ends at once); from now on the model's collectives fail after `timeout_s()`."""
    dist.barrier(group=control)
    _set_timeout(timeout_s())


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
