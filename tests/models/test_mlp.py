"""Gated MLPs (SwiGLU, GeGLU) against transformers' Llama and Gemma 2 MLPs."""

import attrs
import pytest
import torch

from unified_attn.models import ModelConfig
from unified_attn.models.mlp import MLP

llama = pytest.importorskip("transformers.models.llama.modeling_llama")
gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
transformers = pytest.importorskip("transformers")

OURS = ModelConfig(
    vocab_size=8, hidden_size=128, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2
)
SIZES = dict(hidden_size=128, intermediate_size=96, num_attention_heads=4, head_dim=32)


def test_mlp_matches_llama():
    ours, theirs = MLP(OURS), llama.LlamaMLP(transformers.LlamaConfig(**SIZES))
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2))
    assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_geglu_matches_gemma2(dtype):
    ours = MLP(attrs.evolve(OURS, mlp_kind="geglu")).to(dtype)
    theirs = gemma2.Gemma2MLP(transformers.Gemma2Config(**SIZES)).to(dtype)
    with torch.no_grad():
        for param in theirs.parameters():
            param.normal_(generator=torch.Generator().manual_seed(param.numel()))
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2)).to(dtype)
    assert torch.equal(ours(x), theirs(x))
