"""`kernels/launch.FastLaunch`: off CUDA (Triton's interpreter) every call is the kernel's own
launch; its cache key separates what Triton specializes on (the compiled path runs on the GPU:
tests/gpu/test_triton_gpu.py and benchmarks/decode_fixed_cost.py go through it)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from unified_attn.kernels.launch import FastLaunch, _arg_key


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
