"""RoPE (default, llama3, linear, YaRN; Gemma 3's local and global) against transformers'
rotary embeddings."""

import attrs
import pytest
import torch

from unified_attn.models import ModelConfig, RopeScaling
from unified_attn.models.rope import RotaryEmbedding, rope_attention_scaling, rope_inv_freq

llama = pytest.importorskip("transformers.models.llama.modeling_llama")
gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
transformers = pytest.importorskip("transformers")
LlamaConfig = transformers.LlamaConfig

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


def our_config(
    scaling: RopeScaling | None = None, head_size: int = 32, theta: float = 50000.0
) -> ModelConfig:
    return ModelConfig(
        vocab_size=8,
        hidden_size=128,
        intermediate_size=96,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_size=head_size,
        rope_theta=theta,
        rope_scaling=scaling,
    )


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


YARN_CASES = [
    dict(factor=32.0, original_max_position_embeddings=4096, truncate=False),  # GPT-OSS
    dict(factor=4.0, original_max_position_embeddings=64),  # truncate defaults to True
    dict(factor=8.0, original_max_position_embeddings=128, beta_fast=16.0, beta_slow=2.0),
    dict(factor=4.0, original_max_position_embeddings=64, attention_factor=0.7),
    dict(factor=40.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.5),
    dict(factor=1.0, original_max_position_embeddings=64),
]


def gpt_oss_config(yarn: dict, head_dim: int) -> "transformers.GptOssConfig":
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, **yarn}
    return transformers.GptOssConfig(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        rope_parameters=rope,
        max_position_embeddings=512,
    )


@pytest.mark.parametrize("yarn", YARN_CASES)
@pytest.mark.parametrize("head_size", [16, 64])
def test_yarn_matches_transformers(yarn, head_size):
    theirs = gpt_oss.GptOssRotaryEmbedding(gpt_oss_config(yarn, head_size))
    scaling = RopeScaling(rope_type="yarn", **yarn)
    assert torch.equal(rope_inv_freq(head_size, 150000.0, scaling), theirs.inv_freq)
    assert rope_attention_scaling(scaling) == theirs.attention_scaling


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_yarn_rotary_apply_matches_gpt_oss(dtype):
    yarn = YARN_CASES[0]
    gen = torch.Generator().manual_seed(3)
    positions = torch.tensor([0, 1, 5, 200, 511])
    q = torch.randn(5, 4, 64, generator=gen).to(dtype)
    k = torch.randn(5, 2, 64, generator=gen).to(dtype)
    scaling = RopeScaling(rope_type="yarn", **yarn)
    ours = RotaryEmbedding(our_config(scaling, head_size=64, theta=150000.0))
    q_ours, k_ours = ours(positions, q, k)
    cos, sin = gpt_oss.GptOssRotaryEmbedding(gpt_oss_config(yarn, 64))(q, positions[None])
    q_hf, k_hf = gpt_oss.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
    )
    assert torch.equal(q_ours, q_hf[0].transpose(0, 1))
    assert torch.equal(k_ours, k_hf[0].transpose(0, 1))


def test_gemma3_local_and_global_rope_match_transformers():
    gemma3 = pytest.importorskip("transformers.models.gemma3.modeling_gemma3")
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
    }
    config = transformers.Gemma3TextConfig(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_parameters=rope,
        max_position_embeddings=512,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
    )
    theirs = gemma3.Gemma3RotaryEmbedding(config)
    ours = attrs.evolve(
        our_config(RopeScaling(rope_type="linear", factor=8.0), theta=1_000_000.0),
        local_rope_theta=10000.0,
    )
    positions = torch.tensor([0, 3, 100, 511])
    x = torch.zeros(4, 4, 32)
    for local, layer_type in [(True, "sliding_attention"), (False, "full_attention")]:
        rotary = RotaryEmbedding(ours, local=local)
        assert torch.equal(rotary.inv_freq, getattr(theirs, f"{layer_type}_inv_freq"))
        cos, sin = theirs(x, positions[None], layer_type)
        assert torch.equal(rotary.cos_sin(positions, torch.float32)[0], cos[0])
        assert torch.equal(rotary.cos_sin(positions, torch.float32)[1], sin[0])
