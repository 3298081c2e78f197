"""RMSNorm, RoPE (default, llama3, linear) and the MLP against transformers' Llama modules."""

import pytest
import torch

from unified_attn.models import ModelConfig, RopeScaling
from unified_attn.models.layers import MLP, RMSNorm, RotaryEmbedding, rope_inv_freq

llama = pytest.importorskip("transformers.models.llama.modeling_llama")
LlamaConfig = pytest.importorskip("transformers").LlamaConfig

LLAMA3 = dict(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
)


def hf_config(rope_scaling: dict | None = None, head_dim: int = 32) -> "LlamaConfig":
    rope = {"rope_type": "default", "rope_theta": 50000.0, **(rope_scaling or {})}
    return LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        head_dim=head_dim,
        intermediate_size=96,
        rope_parameters=rope,
        max_position_embeddings=512,
    )


def our_config(scaling: RopeScaling | None = None, head_size: int = 32) -> ModelConfig:
    return ModelConfig(
        vocab_size=8,
        hidden_size=128,
        intermediate_size=96,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_size=head_size,
        rope_theta=50000.0,
        rope_scaling=scaling,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_llama(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 128, generator=gen) * 3).to(dtype)
    weight = torch.randn(128, generator=gen).to(dtype)
    ours, theirs = RMSNorm(128, 1e-5).to(dtype), llama.LlamaRMSNorm(128, eps=1e-5).to(dtype)
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize(
    ("hf_scaling", "ours"),
    [
        (None, None),
        ({"rope_type": "llama3", **LLAMA3}, RopeScaling(**LLAMA3)),
        ({"rope_type": "linear", "factor": 4.0}, RopeScaling(rope_type="linear", factor=4.0)),
    ],
)
@pytest.mark.parametrize("head_size", [32, 128])
def test_inv_freq_matches_transformers(hf_scaling, ours, head_size):
    theirs = llama.LlamaRotaryEmbedding(hf_config(hf_scaling, head_size)).inv_freq
    assert torch.equal(rope_inv_freq(head_size, 50000.0, ours), theirs)


def test_llama3_scaling_changes_low_frequencies_only():
    plain, scaled = (
        rope_inv_freq(128, 500000.0),
        rope_inv_freq(128, 500000.0, RopeScaling(**LLAMA3)),
    )
    assert torch.equal(plain[:4], scaled[:4]) and torch.allclose(plain[-1] / 8, scaled[-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_apply_matches_transformers(dtype):
    gen = torch.Generator().manual_seed(1)
    positions = torch.tensor([0, 1, 2, 7, 100, 3, 511])
    q = torch.randn(7, 4, 32, generator=gen).to(dtype)
    k = torch.randn(7, 2, 32, generator=gen).to(dtype)
    rotary = RotaryEmbedding(our_config(RopeScaling(**LLAMA3)))
    q_ours, k_ours = rotary(positions, q, k)
    hf_rotary = llama.LlamaRotaryEmbedding(hf_config({"rope_type": "llama3", **LLAMA3}))
    cos, sin = hf_rotary(q, positions[None])  # [1, T, D]
    # transformers layout: [B, H, T, D]
    q_hf, k_hf = llama.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
    )
    assert torch.equal(q_ours, q_hf[0].transpose(0, 1))
    assert torch.equal(k_ours, k_hf[0].transpose(0, 1))


def test_mlp_matches_llama():
    ours, theirs = MLP(our_config()), llama.LlamaMLP(hf_config())
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2))
    assert torch.equal(ours(x), theirs(x))
