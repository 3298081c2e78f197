"""The rotary embedding kernel (`kernels/layers/rotary.py`; CPU: the interpreter) against the torch
`models.rope.RotaryEmbedding`, which the model runs off CUDA and the HF parity tests check
against transformers: neox over the whole head and partial (Qwen3-Next, Bamba), interleaved
(Llama 4), scaled frequencies, a per-token table or positions into a cache, strided q and k."""

from __future__ import annotations

import attrs
import pytest
import torch

from unified_attn.kernels.layers.rotary import apply_rotary
from unified_attn.models.config import ModelConfig, RopeScaling
from unified_attn.models.rope import RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BASE = ModelConfig(vocab_size=16, hidden_size=64, intermediate_size=64, num_layers=1,
                   num_heads=4, num_kv_heads=2, head_size=64)  # fmt: skip
YARN = RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=256)
LLAMA3 = RopeScaling(factor=8.0, original_max_position_embeddings=64)
CONFIGS = {
    "neox": BASE,
    "neox-yarn": attrs.evolve(BASE, rope_scaling=YARN),  # attention-scaled cos and sin
    "partial-quarter": attrs.evolve(BASE, partial_rotary_factor=0.25),
    "partial-half-96": attrs.evolve(BASE, head_size=96, partial_rotary_factor=0.5),
    "interleaved-llama3": attrs.evolve(BASE, rope_style="interleaved", rope_scaling=LLAMA3),
    "odd-head-40": attrs.evolve(BASE, head_size=40),
}


def rotary(name: str) -> RotaryEmbedding:
    return RotaryEmbedding(CONFIGS[name]).to(DEVICE)


def qk(config: ModelConfig, tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(tokens)
    d = config.head_size
    q = torch.randn(tokens, config.num_heads, d, generator=gen).to(dtype).to(DEVICE)
    k = torch.randn(tokens, config.num_kv_heads, d, generator=gen).to(dtype).to(DEVICE)
    return q, k


def assert_rotated(got: torch.Tensor, want: torch.Tensor) -> None:
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # rounds each product as torch does: one rounding apart at most
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary_in_place_matches_the_torch_rotary(name, dtype):
    emb = rotary(name)
    positions = torch.tensor([0, 1, 7, 300, 4095, 42], device=DEVICE)
    q, k = qk(CONFIGS[name], len(positions), dtype)
    want_q, want_k = emb(positions, q, k)
    style = "interleaved" if emb.interleaved else "neox"
    apply_rotary(q, k, emb.cos_sin_table(positions), style=style)
    assert_rotated(q, want_q)
    assert_rotated(k, want_k)


@pytest.mark.parametrize("name", ["neox", "partial-half-96", "interleaved-llama3"])
def test_positions_into_a_cache_equal_a_per_token_table(name):
    emb = rotary(name)
    cache = emb.cos_sin_table(torch.arange(512, device=DEVICE))  # [positions, rotary_dim]
    positions = torch.tensor([5, 0, 511, 77, 77], device=DEVICE)
    q, k = qk(CONFIGS[name], len(positions), torch.float32)
    q2, k2 = q.clone(), k.clone()
    style = "interleaved" if emb.interleaved else "neox"
    apply_rotary(q, k, cache, positions=positions, style=style)
    apply_rotary(q2, k2, emb.cos_sin_table(positions), style=style)
    assert torch.equal(q, q2) and torch.equal(k, k2)


def test_strided_q_and_k_of_a_packed_projection_and_channels_past_the_rotary_ones():
    emb = rotary("partial-quarter")  # 16 of 64 channels rotate
    config, tokens = CONFIGS["partial-quarter"], 3
    qkv = torch.randn(tokens, (4 + 2 + 2) * 64, generator=torch.Generator().manual_seed(0))
    qkv = qkv.to(DEVICE)
    q = qkv[:, : 4 * 64].view(tokens, 4, 64)  # token stride 512, not 256
    k = qkv[:, 4 * 64 : 6 * 64].view(tokens, 2, 64)
    v_before = qkv[:, 6 * 64 :].clone()
    positions = torch.tensor([3, 9, 1000], device=DEVICE)
    want_q, want_k = emb(positions, q.clone(), k.clone())
    apply_rotary(q, k, emb.cos_sin_table(positions))
    assert_rotated(q, want_q)
    assert_rotated(k, want_k)
    assert torch.equal(qkv[:, 6 * 64 :], v_before)  # v untouched
    assert config.rotary_dim == 16


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(style="gptj"), "style must be one of .* got 'gptj'"),
        (dict(k=torch.zeros(3, 2, 32)), r"q must be \[T, Hq, D\] and k \[T, Hk, D\]"),
        (dict(k=torch.zeros(3, 2, 64, dtype=torch.float16)), "share one dtype"),
        (dict(q=torch.zeros(3, 64, 4).transpose(1, 2)), "need contiguous channels"),
        (dict(cos_sin=torch.zeros(3, 66)), r"R even and at most the head size 64"),
        (dict(cos_sin=torch.zeros(3, 16, dtype=torch.float16)), r"\[rows, R\] float32"),
        (dict(cos_sin=torch.zeros(5, 16)), r"one row per token \(3\), got 5"),
        (dict(positions=torch.zeros(3)), r"positions must be \[3\] integers"),
    ],
)
def test_bad_inputs_are_named(change, message):
    args = dict(q=torch.zeros(3, 4, 64), k=torch.zeros(3, 2, 64), cos_sin=torch.zeros(3, 16))
    args.update({key: v for key, v in change.items() if key in args})
    kwargs = {key: v for key, v in change.items() if key not in args}
    on_device = {key: v.to(DEVICE) if isinstance(v, torch.Tensor) else v
                 for key, v in (args | kwargs).items()}  # fmt: skip
    with pytest.raises(ValueError, match=message):
        apply_rotary(**on_device)
