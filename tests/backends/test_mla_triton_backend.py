"""`TritonMLABackend` (the MLA kernels of `mla_ops` behind the reference MLA backend's seams) on
the CPU interpreter: a DeepSeek-V3 checkpoint through the engine gives transformers' greedy
tokens and logits (float32), with chunked prefill and decode in the same steps; what the kernel
cannot serve is refused with reasons."""

from __future__ import annotations

import pytest
import torch

from tests.models.hf_models import save_hf_model
from tests.models.test_deepseek_hf import check_tokens, make_deepseek, prompts
from unified_attn import LLMEngine, SamplingParams
from unified_attn.backends.triton.mla_backend import TritonMLABackend
from unified_attn.selector import SelectorConfig

NUM_TOKENS = 6


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    hf = make_deepseek("v3")
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("v3"))


def test_engine_matches_transformers(v3):
    hf, path = v3
    # 7-token chunks: prefill rows of one request share steps with other requests' decodes
    engine = LLMEngine(str(path), backend="triton-mla", kv_cache_memory="1MiB",
                       max_num_batched_tokens=7, block_size=16, max_model_len=64)  # fmt: skip
    assert engine.backend_cls is TritonMLABackend
    batch = prompts([9, 3, 12])
    params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, return_logits=True)
    for prompt, out in zip(batch, engine.generate(batch, params), strict=True):
        full = check_tokens(hf, prompt, out.output_token_ids)
        sampled = full[len(prompt) - 1 : len(prompt) - 1 + NUM_TOKENS]
        assert (out.logits - sampled).abs().max() < 1e-4


@pytest.mark.parametrize(
    "options, reason",
    [
        (dict(sliding_window=64), "sliding windows are not supported"),
        (dict(use_batch_invariant=True), "batch invariance is not supported"),
        (dict(dtype=torch.float64), "dtype torch.float64 is not one of"),
    ],
)
def test_what_the_kernel_cannot_serve_is_refused(options, reason):
    cfg = SelectorConfig(
        **{"head_size": 48, "dtype": torch.float32, "layer_kind": "mla", **options}
    )
    assert any(reason in r for r in TritonMLABackend.validate_configuration(cfg))


def test_latent_widths_the_kernel_cannot_tile_are_refused():
    with pytest.raises(ValueError, match="kv_lora_rank=24 and qk_rope_head_dim=16 must be"):
        TritonMLABackend(head_size=40, dtype=torch.float32, kv_lora_rank=24)
