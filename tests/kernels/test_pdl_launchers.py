"""The decode step's kernels launch with programmatic dependent launch where `pdl_enabled` says
so (`kernels/pdl.py`: Hopper and later, unless `UNIFIED_ATTN_PDL=0`): each launcher passes its
answer as `launch_pdl`. CPU: the interpreter runs the kernels without it (the recorder below
asks for what the launcher wanted, then launches with it off); the GPU suites run it on."""

from __future__ import annotations

import pytest
import torch

from tests.backends.test_triton_kernels import DTYPES, run_case
from unified_attn.backends.triton import ops
from unified_attn.backends.triton.ops import SplitPlan
from unified_attn.kernels.launch import FastLaunch
from unified_attn.kernels.layers import activation, norm, rotary, skinny_gemm

DECODE_KERNELS = {
    "rms_norm_kernel", "rotary_kernel", "act_and_mul_kernel", "skinny_gemm_kernel",
    "write_kv_cache_kernel", "unified_attention_kernel", "merge_segments_kernel",
}  # fmt: skip


@pytest.fixture
def asked(monkeypatch) -> dict[str, object]:
    """Each kernel's `launch_pdl` as its launcher asked, with `pdl_enabled` answering True."""
    calls: dict[str, object] = {}
    original = FastLaunch.launch

    def record(self, grid, args, kwargs):
        calls[self.kernel.fn.__name__] = kwargs.get("launch_pdl")
        original(self, grid, args, {**kwargs, "launch_pdl": False})

    monkeypatch.setattr(FastLaunch, "launch", record)
    for module in (norm, rotary, activation, skinny_gemm, ops):
        monkeypatch.setattr(module, "pdl_enabled", lambda device: True)
    return calls


def test_every_kernel_of_a_decode_layer_asks_for_pdl(asked):
    x = torch.randn(2, 64)
    weight = torch.ones(64)
    norm.rms_norm(x, weight, 1e-6, "llama")
    norm.add_rms_norm(x, torch.randn(2, 64), weight, 1e-6, "llama")
    q, k = torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    rotary.apply_rotary(q, k, torch.randn(2, 16))
    activation.act_and_mul(torch.randn(2, 128), "silu")
    skinny_gemm.skinny_linear(x, torch.randn(32, 64))
    run_case(hq=4, hkv=2, d=64, bs=16, computed=[70, 3], new=[1, 1], dtype=DTYPES[0],
             split=SplitPlan(num_segments=4, segment=32))  # fmt: skip
    assert asked == dict.fromkeys(DECODE_KERNELS, True)
