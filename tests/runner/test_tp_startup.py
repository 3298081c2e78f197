"""Tensor-parallel startup: until every rank has built (`startup_done`), the model group's
collectives wait `UNIFIED_ATTN_TP_STARTUP_TIMEOUT_S` for a slow rank (kernel compiles, graph
capture); afterwards a silent rank fails them within `UNIFIED_ATTN_TP_TIMEOUT_S`. Two gloo
ranks in spawned processes, one of them late by more than the short timeout each time."""

from __future__ import annotations

import multiprocessing as mp
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from unified_attn.distributed.tp_process_group import (
    free_port,
    join_group,
    leave_group,
    startup_done,
    startup_timeout_s,
)

LATE_S = 2.5  # the slow rank's delay, more than the short timeout below


def _rank(rank: int, port: int, results: mp.Queue) -> None:
    config = SimpleNamespace(device="cpu", tensor_parallel_size=2)
    control = join_group(config, rank, 2, port)
    try:
        tensor = torch.ones(1)
        if rank == 1:
            time.sleep(LATE_S)
        dist.all_reduce(tensor)  # while building: waits for the late rank
        results.put((rank, "startup", float(tensor.item())))
        startup_done(control)
        if rank == 1:
            time.sleep(LATE_S)
        try:
            dist.all_reduce(tensor)
            results.put((rank, "serving", "ok"))
        except Exception as error:  # the short timeout
            results.put((rank, "serving", type(error).__name__))
    finally:
        leave_group()


def test_collectives_wait_for_a_slow_rank_while_building_and_not_after(monkeypatch):
    monkeypatch.setenv("UNIFIED_ATTN_TP_TIMEOUT_S", "1")
    monkeypatch.setenv("UNIFIED_ATTN_TP_STARTUP_TIMEOUT_S", "60")
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_rank, args=(r, port, results)) for r in range(2)]
    for process in processes:
        process.start()
    got = {}
    for _ in range(4):
        rank, phase, value = results.get(timeout=60)
        got[rank, phase] = value
    for process in processes:
        process.join(timeout=30)
    assert got[0, "startup"] == got[1, "startup"] == 2.0  # the sum, after the late rank came
    assert got[0, "serving"] != "ok"  # rank 0 gave up on the silent rank after ~1 s


def test_a_bad_startup_timeout_is_refused(monkeypatch):
    monkeypatch.setenv("UNIFIED_ATTN_TP_STARTUP_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="UNIFIED_ATTN_TP_STARTUP_TIMEOUT_S='soon': expected a "
                       "positive number of seconds"):  # fmt: skip
        startup_timeout_s()
