"""`kernels/launch.FastLaunch`: off CUDA (Triton's interpreter) every call is the kernel's own
launch; its cache key separates what Triton specializes on (the compiled path runs on the GPU:
tests/gpu/test_triton_gpu.py and benchmarks/decode_fixed_cost.py go through it)."""

from __future__ import annotations

import types

import pytest
import torch
import triton
import triton.language as tl

from unified_attn.kernels.launch import FastLaunch, FastLaunchers, _arg_key, fast_launchers


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, factor, BLOCK: tl.constexpr = 64):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    tl.store(out_ptr + i, tl.load(x_ptr + i, mask=ok) * factor, mask=ok)


def test_off_cuda_it_launches_through_the_kernel_with_defaults_filled():
    x = torch.arange(100, dtype=torch.float32)
    out = torch.empty_like(x)
    fast = FastLaunch(_scale_kernel)
    fast[(2,)](x, out, 100, 2.0)  # BLOCK from its default
    assert torch.equal(out, 2 * x)
    assert not fast.compiled  # nothing cached off CUDA
    if not fast.passthrough:  # compiled kernels (not the interpreter's) list their parameters
        assert fast._values((x, out, 100, 2.0), {})[-1] == 64


def test_the_key_separates_what_triton_specializes_on():
    assert _arg_key(1) != _arg_key(2)  # == 1
    assert _arg_key(16) != _arg_key(17)  # divisibility by 16
    assert _arg_key(32) == _arg_key(48)
    assert _arg_key(2**31 + 16) != _arg_key(32)  # 64-bit
    assert _arg_key(True) != _arg_key(1) and _arg_key(None) is None
    assert _arg_key(0.5) == _arg_key(3.0)
    base = torch.zeros(64, dtype=torch.float16)
    assert _arg_key(base) != _arg_key(base[1:])  # 16-byte alignment
    assert _arg_key(base) != _arg_key(torch.zeros(64, dtype=torch.bfloat16))
    assert _arg_key(base) == _arg_key(base[8:])



def test_fast_launchers_wrap_each_kernel_of_a_module_once():
    launchers = FastLaunchers(types.SimpleNamespace(scale_kernel=_scale_kernel))
    fast = launchers.scale_kernel
    assert isinstance(fast, FastLaunch) and fast.kernel is _scale_kernel
    assert launchers.scale_kernel is fast  # made once, kept
    x = torch.arange(10, dtype=torch.float32)
    out = torch.empty_like(x)
    fast[(1,)](x, out, 10, 3.0)
    assert torch.equal(out, 3 * x)
    with pytest.raises(AttributeError):
        getattr(launchers, "missing_kernel")  # noqa: B009
    with pytest.raises(AttributeError):  # private names (copy and pickle probes) are not kernels
        getattr(launchers, "__deepcopy__")  # noqa: B009


def test_launchers_sharing_a_kernels_module_share_its_launchers():
    from unified_attn.backends.triton import gated_delta_ops, ssm_ops
    from unified_attn.kernels.ssm import ssd_chunked

    assert fast_launchers(ssd_chunked) is fast_launchers(ssd_chunked)
    assert ssm_ops.ssd_chunked is gated_delta_ops.ssd_chunked
