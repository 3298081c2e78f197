"""DeepSeek-V4 on the Triton kernels on CUDA in bf16 (run through the device tool): the preset's
prompt logits on `triton-deepseek-v4` are as close to a float32 run as the reference backends'
bf16 logits are, and the selector picks the Triton backend on CUDA. (float32 equality with the
reference: tests/backends/test_v4_triton.py, also on the GPU.)"""

from __future__ import annotations

import pytest
import torch

from unified_attn import LLMEngine, SamplingParams
from unified_attn.backends.triton.deepseek_v4_backend import TritonDeepseekV4Backend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [[(5 * i + 11 * j) % 300 + 3 for j in range(n)] for i, n in enumerate([200, 37, 90])]


def prompt_logits(backend: str | None, dtype: str = "bfloat16") -> torch.Tensor:
    engine = LLMEngine("deepseek-v4-like", backend=backend, device="cuda", dtype=dtype,
                       max_num_batched_tokens=64, kv_cache_memory="512MiB")  # fmt: skip
    if backend is None:
        assert engine.backend_cls is TritonDeepseekV4Backend  # the selector's choice on CUDA
    params = SamplingParams(max_tokens=1, prompt_logits=True)
    return torch.cat([out.prompt_logits.float() for out in engine.generate(PROMPTS, params)])


def test_bf16_prompt_logits_are_as_close_to_float32_as_the_reference_backends():
    exact = prompt_logits("deepseek-v4-reference", "float32")
    reference_error = (prompt_logits("deepseek-v4-reference") - exact).abs()
    triton_error = (prompt_logits(None) - exact).abs()
    print(f"bf16 error: reference max {reference_error.max():.3g} mean "
          f"{reference_error.mean():.3g}; triton max {triton_error.max():.3g} mean "
          f"{triton_error.mean():.3g}")  # fmt: skip
    assert torch.isfinite(triton_error).all()
    assert triton_error.mean() <= 1.5 * reference_error.mean()
    assert triton_error.max() <= 2 * reference_error.max()
