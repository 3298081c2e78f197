"""RMSNorm styles against transformers' Llama, Gemma 2 and GPT-OSS norms; layer wiring."""

import pytest
import torch

from unified_attn.models.layers import RMSNorm

llama = pytest.importorskip("transformers.models.llama.modeling_llama")
gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_llama(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 128, generator=gen) * 3).to(dtype)
    weight = torch.randn(128, generator=gen).to(dtype)
    ours, theirs = RMSNorm(128, 1e-5).to(dtype), llama.LlamaRMSNorm(128, eps=1e-5).to(dtype)
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    assert torch.equal(ours(x), theirs(x))


NORMS = {
    "gemma": lambda: gemma2.Gemma2RMSNorm(128, eps=1e-6),
    "float32": lambda: gpt_oss.GptOssRMSNorm(128, eps=1e-6),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("style", sorted(NORMS))
def test_rms_norm_styles_match_transformers(style, dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 128, generator=gen) * 3).to(dtype)
    weight = torch.randn(128, generator=gen).to(dtype)
    ours, theirs = RMSNorm(128, 1e-6, style).to(dtype), NORMS[style]().to(dtype)
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    assert torch.equal(ours(x), theirs(x))


def test_gemma_norm_starts_as_identity_scale():
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.equal(RMSNorm(128, 1e-6, "gemma")(x), expected)
