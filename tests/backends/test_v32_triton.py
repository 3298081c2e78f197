"""DeepSeek-V3.2 on the Triton kernels (CPU: the interpreter): the sparse MLA attention against
the reference partial attention at a kernel width and at a width the kernel does not take, then
a tiny V3.2 checkpoint with a 48 + 16 latent through the engine on `triton-deepseek-v3.2`
against transformers, with chunked prefill not aligned to blocks."""

from __future__ import annotations

import pytest
import torch

from tests.backends.test_v4_triton import gathered_case
from tests.models.hf_models import make_hf_model, save_hf_model
from tests.models.test_deepseek_hf import MLA, PROMPT_PARAMS, check_engine, prompts
from tests.models.test_deepseek_v32_hf import MEMORY, V32
from unified_attn import LLMEngine
from unified_attn.backends.deepseek_v4_steps import partial_attention
from unified_attn.backends.triton.sparse_mla_backend import (
    TritonDeepseekV32IndexerBackend,
    TritonSparseMLABackend,
    sparse_mla_attention,
)


@pytest.mark.parametrize("width", [64, 48])  # a kernel width, and the torch fallback
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sparse_mla_attention_matches_the_reference(width, dtype):
    q, cache, blocks, offsets, valid = gathered_case(3, 5, 4, width, 10, 8, 24, dtype)
    out, lse = torch.empty_like(q), torch.empty(5, 4)
    sparse_mla_attention(q, cache, blocks, offsets, valid, 0.2, out, lse)
    want, want_lse = torch.empty_like(q, dtype=torch.float32), torch.empty(5, 4)
    partial_attention(q.float(), cache.float()[blocks, offsets], valid, 0.2, want, want_lse)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert (out.float() - want).abs().max() < tol
    seen = want_lse.isfinite()
    assert (lse[seen] - want_lse[seen]).abs().max() < tol and not lse[~seen].isfinite().any()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = make_hf_model("deepseek_v32", **{**MLA, "kv_lora_rank": 48}, **V32)
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("v32-triton"))


def test_engine_on_the_kernels_matches_transformers(checkpoint):
    hf, path = checkpoint
    engine = LLMEngine(str(path), kv_cache_memory=MEMORY, backend="triton-deepseek-v3.2",
                       max_num_batched_tokens=13, block_size=8, max_model_len=104)  # fmt: skip
    assert engine.backend_cls is TritonSparseMLABackend
    kinds = {type(backend) for _, backend in engine.model.attention_layers()}
    assert kinds == {TritonSparseMLABackend, TritonDeepseekV32IndexerBackend}
    batch = prompts([64, 5], seed=8)
    check_engine(hf, engine.generate(batch, PROMPT_PARAMS), batch)
