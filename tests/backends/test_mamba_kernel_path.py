"""`Mamba2StateBackend`'s CUDA path (`mamba_device.py`: the Triton convolution and SSD kernels
over host-planned slots) run on the CPU through Triton's interpreter, forced by marking the
backend's states as on CUDA: an engine of a tiny Nemotron-H (scan chunks of 16, the kernels'
smallest) gives transformers' tokens and logits with chunked prefill, "all" mode's checkpoints
at chunk ends, and prefix hits."""

import pytest

from tests.backends.kernel_path import force_kernel_path
from tests.models.hf_models import make_family_model, save_hf_model
from tests.runner.test_engine_hf_parity import PARAMS, check_against_hf, prompts
from unified_attn import LLMEngine
from unified_attn.backends.mamba_state import Mamba2StateBackend


@pytest.fixture
def kernel_path(monkeypatch):
    """Every forward of the backend takes the kernels; counts their calls."""
    return force_kernel_path(monkeypatch, Mamba2StateBackend, "unified_attn.backends.mamba_device")


def test_kernel_path_matches_transformers(kernel_path, tmp_path):
    hf = make_family_model("nemotron-h", chunk_size=16)
    path = save_hf_model(hf, tmp_path / "nemotron-h")
    engine = LLMEngine(str(path), kv_cache_memory="2MiB", block_size=8,
                       max_num_batched_tokens=13, mamba_cache_mode="all")  # fmt: skip
    first = prompts([3], seed=1, shared=64)
    second = [[*first[0][:64], 5, 6, 7], [9] * 6]  # a hit of 64 tokens (32-aligned)
    for batch in (first, second):
        check_against_hf(hf, engine.generate(batch, PARAMS), batch, prompt_logits=False)
    assert kernel_path["decode"] > 0 and kernel_path["varlen"] > 0
    hits = engine.kv_cache_manager.group_stats()
    assert all(g["hit_blocks"] > 0 for g in hits), hits
