"""`FastLaunch`: a Triton JIT kernel launched through its compiled launcher once it has been
compiled for a call's specialization, past Triton's Python dispatch.

`kernel[grid](*args)` binds and specializes every argument, hashes the result and looks the
compiled kernel up on each call: about 45 us for the paged attention kernel's 52 arguments on an
H200's host, where the compiled kernel's own launcher takes 16 (benchmarks/README.md, "Paged
decode fixed cost"). Eager decode steps pay that per layer. `FastLaunch` keys its cache on what
Triton specializes on, computed directly: every constexpr and launch option by value, tensors by
dtype and 16-byte alignment, integers by being 1, by divisibility by 16 and by fitting 32 bits,
booleans and None by value, floats by type. Calls whose key is new go through `kernel[grid]`
(compiling if needed), which returns the compiled kernel kept for the key; later calls with the
key launch it directly. The key is at least as fine as Triton's own, so a cached kernel is the
one Triton would pick. Off CUDA (Triton's interpreter) every call is `kernel[grid]`.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from triton import knobs
from triton.runtime import driver

_LAUNCH_OPTIONS = (
    "num_warps", "num_stages", "maxnreg", "num_ctas", "enable_fp_fusion", "launch_pdl",
)  # fmt: skip


def _int_key(value: int) -> tuple[bool, bool, bool]:
    return value == 1, value % 16 == 0, -(2**31) <= value < 2**31


def _arg_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return _int_key(value)
    if isinstance(value, float):
        return float
    return value  # a dtype or another constexpr-like value: by value


class FastLaunch:
    """`FastLaunch(kernel)[grid](*args, **kwargs)` launches like `kernel[grid](...)`."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        params = getattr(kernel, "params", [])  # none under Triton's interpreter
        self.passthrough = not params
        self.names = [p.name for p in params]
        self.constexpr = [p.is_constexpr for p in params]
        signature = inspect.signature(kernel.fn)
        self.defaults = {
            name: p.default
            for name, p in signature.parameters.items()
            if p.default is not inspect.Parameter.empty
        }
        self.compiled: dict[tuple, Any] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launch(grid, args, kwargs)

        return launch

    def _values(self, args: tuple, kwargs: dict[str, Any]) -> list[Any]:
        """Every kernel parameter's value, in the kernel's order."""
        values = list(args)
        for name in self.names[len(args) :]:
            values.append(kwargs[name] if name in kwargs else self.defaults[name])
        return values

    def launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> None:
        if self.passthrough:
            self.kernel[grid](*args, **kwargs)
            return
        values = self._values(args, kwargs)
        if not isinstance(values[0], torch.Tensor) or not values[0].is_cuda:
            self.kernel[grid](*args, **kwargs)
            return
        key = (
            tuple(v if c else _arg_key(v) for v, c in zip(values, self.constexpr, strict=True)),
            tuple(kwargs.get(option) for option in _LAUNCH_OPTIONS),
            values[0].device.index,  # a compiled kernel is loaded on one device
        )
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, **kwargs)
            compiled._init_handles()  # loaded already by that launch; a no-op then
            self.compiled[key] = compiled
            return
        device = driver.active.get_current_device()
        stream = driver.active.get_current_stream(device)
        g = tuple(grid) + (1,) * (3 - len(grid))
        hooks = knobs.runtime
        compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata,
                     compiled.launch_metadata(g, stream, *values), hooks.launch_enter_hook,
                     hooks.launch_exit_hook, *values)  # fmt: skip


@functools.cache
def fast_launchers(module: Any) -> FastLaunchers:
    """The one `FastLaunchers` of a kernels module (launchers that share a module share its
    compiled kernels)."""
    return FastLaunchers(module)


class FastLaunchers:
    """A kernels module's Triton kernels, each through its own `FastLaunch`:
    `FastLaunchers(module).name_kernel[grid](...)` launches like `module.name_kernel[grid](...)`.
    Each kernel's `FastLaunch` is made on first use and kept; `fast_launchers` gives one per
    module."""

    def __init__(self, module: Any) -> None:
        self._module = module
        self._launchers: dict[str, FastLaunch] = {}

    def __getattr__(self, name: str) -> FastLaunch:
        if name.startswith("_"):
            raise AttributeError(name)
        launcher = self._launchers.get(name)
        if launcher is None:
            launcher = self._launchers[name] = FastLaunch(getattr(self._module, name))
        return launcher
