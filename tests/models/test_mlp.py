"""Gated MLPs (SwiGLU, GeGLU, fused gate-up) against transformers' Llama, Gemma 2 and Phi-3 MLPs;
the MLP factory's per-layer choice."""

import attrs
import pytest
import torch

from unified_attn.models import LayerKind, ModelConfig, MoEConfig
from unified_attn.models.mlp import MLP, make_mlp
from unified_attn.models.moe import MoEMLP, SparseMoEMLP

llama = pytest.importorskip("transformers.models.llama.modeling_llama")
gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
phi3 = pytest.importorskip("transformers.models.phi3.modeling_phi3")
transformers = pytest.importorskip("transformers")

OURS = ModelConfig(
    vocab_size=8, hidden_size=128, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2
)
SIZES = dict(hidden_size=128, intermediate_size=96, num_attention_heads=4, head_dim=32)


def test_mlp_matches_llama():
    ours, theirs = make_mlp(OURS), llama.LlamaMLP(transformers.LlamaConfig(**SIZES))
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2))
    assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_geglu_matches_gemma2(dtype):
    ours = make_mlp(attrs.evolve(OURS, mlp_kind="geglu")).to(dtype)
    theirs = gemma2.Gemma2MLP(transformers.Gemma2Config(**SIZES)).to(dtype)
    with torch.no_grad():
        for param in theirs.parameters():
            param.normal_(generator=torch.Generator().manual_seed(param.numel()))
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2)).to(dtype)
    assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gate_up_matches_phi3(dtype):
    ours = make_mlp(attrs.evolve(OURS, fused_gate_up=True)).to(dtype)
    theirs = phi3.Phi3MLP(transformers.Phi3Config(**SIZES, pad_token_id=0)).to(dtype)
    with torch.no_grad():
        for param in theirs.parameters():
            param.normal_(generator=torch.Generator().manual_seed(param.numel()))
    ours.load_state_dict(theirs.state_dict())  # gate_up_proj [2I, H]: gate rows first
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2)).to(dtype)
    assert torch.equal(ours(x), theirs(x))


def test_moe_model_mlps_per_layer():
    moe = attrs.evolve(
        OURS,
        num_layers=3,
        layer_kinds=[LayerKind.full()] * 3,
        mlp_kind="moe",
        moe=MoEConfig(num_experts=4, top_k=2, expert_kind="swiglu", intermediate_size=32),
        dense_mlp_layers=(1,),
    )
    kinds = [type(make_mlp(moe, i)) for i in range(3)]
    assert kinds == [SparseMoEMLP, MLP, SparseMoEMLP]
    assert make_mlp(moe, 1).down_proj.in_features == 96  # dense layers: intermediate_size
    assert make_mlp(moe, 0).experts.down_proj.shape == (4, 128, 32)  # experts: their own width
    gpt_oss = attrs.evolve(moe, moe=MoEConfig(num_experts=4, top_k=2), dense_mlp_layers=())
    assert isinstance(make_mlp(gpt_oss, 0), MoEMLP)
