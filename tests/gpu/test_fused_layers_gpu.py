"""GPU-only checks of the fused layers (`kernels/layers`, run through the device tool) in bfloat16,
which the CPU interpreter computes wrongly: each kernel against the torch layer it replaces at
Llama-3-8B's widths, and a decoder built on CUDA (fused: UNIFIED_ATTN_FUSED_LAYERS=1) against its
torch path. The engine against transformers with the fused layers:
tests/gpu/test_moe_families_gpu.py."""

from __future__ import annotations

import pytest
import torch

from tests.models.prefill import prefill_logits
from unified_attn.backends.triton import TritonAttentionBackend
from unified_attn.kernels.layers.activation import act_and_mul
from unified_attn.kernels.layers.norm import add_rms_norm, rms_norm
from unified_attn.kernels.layers.rotary import apply_rotary
from unified_attn.models import DecoderModel, get_preset
from unified_attn.models.config import ModelConfig, RopeScaling
from unified_attn.models.layers import RMSNorm
from unified_attn.models.mlp import ACTIVATIONS, KERNEL_ACTIVATIONS
from unified_attn.models.rope import RotaryEmbedding

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def fused_layers_on(monkeypatch):
    """Models built on CUDA run the fused layers (the default; set here so that an environment
    that turns them off does not skip these checks)."""
    monkeypatch.setenv("UNIFIED_ATTN_FUSED_LAYERS", "1")


BF16 = torch.bfloat16
ULP = 2**-7  # bfloat16's relative rounding step
TWO = 2 * ULP  # two roundings (the normalised x then the weight; the activation then the product)


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (2 * torch.randn(*shape, generator=gen, device="cuda")).to(BF16)


@pytest.mark.parametrize("style", ["llama", "float32", "gemma"])
@pytest.mark.parametrize("width", [4096, 5120, 16384, 20000])  # 20000: the chunked path
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_norm_kernels_match_the_torch_layer_in_bf16(style, width, tokens):
    norm = RMSNorm(width, 1e-5, style).cuda().to(BF16)
    norm.weight.data = 1 + 0.5 * rand(width, seed=1)
    x, residual = rand(tokens, width, seed=2), rand(tokens, width, seed=3)
    torch.testing.assert_close(rms_norm(x, norm.weight, 1e-5, style), norm(x),
                               rtol=TWO, atol=TWO)  # fmt: skip
    out, new_residual = add_rms_norm(x, residual, norm.weight, 1e-5, style)
    assert torch.equal(new_residual, x + residual)
    torch.testing.assert_close(out, norm(x + residual), rtol=TWO, atol=TWO)


def test_head_norm_of_strided_q_in_bf16():
    norm = RMSNorm(128, 1e-6).cuda().to(BF16)
    qkv = rand(77, (32 + 16) * 128)
    q = qkv[:, : 32 * 128].view(77, 32, 128)
    torch.testing.assert_close(rms_norm(q, norm.weight, 1e-6, "llama"), norm(q),
                               rtol=TWO, atol=TWO)  # fmt: skip


@pytest.mark.parametrize("kind", ["swiglu", "geglu"])
@pytest.mark.parametrize("tokens", [1, 257])
def test_act_and_mul_matches_the_torch_mlp_in_bf16(kind, tokens):
    gate_up = rand(tokens, 2 * 14336)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(act_and_mul(gate_up, KERNEL_ACTIVATIONS[kind]),
                               ACTIVATIONS[kind](gate) * up, rtol=TWO, atol=TWO)  # fmt: skip


def rotary(rotary_fraction: float, style: str = "neox") -> RotaryEmbedding:
    config = ModelConfig(
        vocab_size=16, hidden_size=4096, intermediate_size=14336, num_layers=1, num_heads=32,
        num_kv_heads=8, head_size=128, partial_rotary_factor=rotary_fraction, rope_style=style,
        rope_theta=500000.0, max_position_embeddings=131072,
        rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=8192),
    )  # fmt: skip
    return RotaryEmbedding(config).cuda()


@pytest.mark.parametrize("fraction", [1.0, 0.25])
def test_neox_rotary_is_bitwise_the_torch_rotary_in_bf16(fraction):
    # the kernel rounds cos, sin, each product and the sum to bf16 as torch's ops do
    emb = rotary(fraction)
    positions = torch.randint(0, 131072, (300,), device="cuda")
    q, k = rand(300, 32, 128, seed=4), rand(300, 8, 128, seed=5)
    want_q, want_k = emb(positions, q, k)
    apply_rotary(q, k, emb.cos_sin_table(positions))
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


def test_interleaved_rotary_matches_the_torch_rotary_in_bf16():
    emb = rotary(1.0, "interleaved")
    positions = torch.randint(0, 131072, (64,), device="cuda")
    q, k = rand(64, 32, 128, seed=6), rand(64, 8, 128, seed=7)
    want_q, want_k = emb(positions, q, k)
    apply_rotary(q, k, emb.cos_sin_table(positions), style="interleaved")
    torch.testing.assert_close(q, want_q, rtol=ULP, atol=ULP)
    torch.testing.assert_close(k, want_k, rtol=ULP, atol=ULP)


@pytest.mark.parametrize("preset", ["tiny-llama", "gemma2-like", "gpt-oss-like"])
def test_a_cuda_decoder_runs_fused_and_stays_close_to_its_torch_path(preset):
    model = DecoderModel(get_preset(preset), TritonAttentionBackend, dtype=BF16, device="cuda")
    model.init_random_weights(0)
    attn = model.model.layers[0].self_attn
    assert model.model.norm.fused and attn.packed is not None  # the fixture's variable
    prompts = [[(7 * i + j) % 256 for j in range(20 + 13 * i)] for i in range(4)]
    fused = prefill_logits(model, prompts, block_size=16)
    model.use_fused_layers(False)
    plain = prefill_logits(model, prompts, block_size=16)
    # the same weights in float32, torch layers: both bf16 paths are measured against it (a
    # router's near tie may flip an expert in either path, so the error is compared on average)
    ref_model = DecoderModel(get_preset(preset), TritonAttentionBackend, dtype=torch.float32,
                             device="cuda")  # fmt: skip
    ref_model.use_fused_layers(False)
    weights = dict(model.named_parameters())
    for name, param in ref_model.named_parameters():
        param.data.copy_(weights[name].float())
    ref = prefill_logits(ref_model, prompts, block_size=16)
    for a, b, r in zip(fused, plain, ref, strict=True):
        fused_err, plain_err = (a - r).abs().mean(), (b - r).abs().mean()
        assert fused_err <= 1.5 * plain_err + 1e-3, (preset, fused_err, plain_err)
