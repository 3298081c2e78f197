"""Force a state backend's CUDA path on the CPU (its Triton kernels then run in the
interpreter): the backend's states are marked as on CUDA when bound, and its kernel entry
points (`decode`, `varlen`) are counted."""

from __future__ import annotations

import importlib
import os

import pytest


def force_kernel_path(monkeypatch, backend_cls, device_module: str) -> dict[str, int]:
    """Patch `backend_cls` (whose module imported `decode` and `varlen` from
    `device_module`); returns the live call counts."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernels run on CPU tensors in Triton's interpreter only (no GPU); "
                    "tests/gpu runs them on the device")
    calls = {"decode": 0, "varlen": 0}
    bind = backend_cls.bind_kv_caches

    def bind_on_cuda(self, kv_caches, block_table_map):
        bind(self, kv_caches, block_table_map)
        self.on_cuda = True

    def counted(name):
        run = getattr(importlib.import_module(device_module), name)

        def wrapper(*args):
            calls[name] += 1
            return run(*args)

        return wrapper

    monkeypatch.setattr(backend_cls, "bind_kv_caches", bind_on_cuda)
    for name in calls:
        monkeypatch.setattr(f"{backend_cls.__module__}.{name}", counted(name))
    return calls
