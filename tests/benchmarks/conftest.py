"""The `bench` fixture: the benchmark script named by the test module's `SCRIPT`, loaded as a
module. The scripts import their shared helpers (`common`, `attn_bench`) from their own
directory, which `python benchmarks/<script>.py` puts on `sys.path`; the fixture does the same."""

from __future__ import annotations

import importlib.util
import sys

import pytest


@pytest.fixture(scope="module")
def bench(request):
    script = request.module.SCRIPT
    spec = importlib.util.spec_from_file_location(f"{script.stem}_bench", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(script.parent))
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)
        sys.path.remove(str(script.parent))
