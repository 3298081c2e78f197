"""Llama 4's pieces against transformers' own: interleaved RoPE with llama3 scaling, the
weightless q/k norm, the NoPE temperature, the sigmoid router feeding the experts' input with a
shared expert; and its config.json translation (defaults, derived layer lists, refusals)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.models.hf_models import LLAMA4_ROPE, SMALL
from unified_attn.models import LayerKind, ModelConfig, MoEConfig
from unified_attn.models.config import AttnTemperature
from unified_attn.models.hf_config import config_from_hf
from unified_attn.models.hf_llama4 import llama4_expert_weights
from unified_attn.models.layers import l2_norm, temperature_scale
from unified_attn.models.moe import InputScaledMoEMLP, TopKRouter
from unified_attn.models.rope import RotaryEmbedding

transformers = pytest.importorskip("transformers")
llama4 = pytest.importorskip("transformers.models.llama4.modeling_llama4")

HF = dict(SMALL, head_dim=16, intermediate_size=32, intermediate_size_mlp=96,
          num_local_experts=4, num_experts_per_tok=2)  # fmt: skip


def hf_text_config(**overrides):
    return transformers.Llama4TextConfig(**{**HF, **overrides})


def ours(**fields) -> ModelConfig:
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
                num_kv_heads=2, head_size=16)  # fmt: skip
    return ModelConfig(**{**base, **fields})


def config_json(**overrides):
    return {**hf_text_config(**overrides).to_dict(), "architectures": ["Llama4ForCausalLM"]}


@pytest.mark.parametrize("rope_parameters", [LLAMA4_ROPE, {"rope_type": "default",
                                                           "rope_theta": 10000.0}])  # fmt: skip
def test_interleaved_rope_matches_transformers(rope_parameters):
    hf_rope = llama4.Llama4TextRotaryEmbedding(hf_text_config(rope_parameters=rope_parameters))
    cfg = config_from_hf(config_json(rope_parameters=rope_parameters))
    assert cfg.rope_style == "interleaved"
    rotary = RotaryEmbedding(cfg)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(50, 4, 16, generator=gen), torch.randn(50, 2, 16, generator=gen)
    positions = torch.arange(50) * 3  # past the scaled wavelengths
    freqs_cis = hf_rope(q, positions[None])
    want_q, want_k = llama4.apply_rotary_emb(q[None], k[None], freqs_cis)
    got_q, got_k = rotary(positions, q, k)
    torch.testing.assert_close(got_q, want_q[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(got_k, want_k[0], rtol=0, atol=1e-6)
    # not the rotate_half form: the same settings in neox style rotate differently
    neox_q, _ = RotaryEmbedding(ours(rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling))(
        positions, q, k
    )
    assert (neox_q - want_q[0]).abs().max() > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2_norm_matches_transformers(dtype):
    x = torch.randn(7, 4, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = llama4.Llama4TextL2Norm(1e-5)(x)
    assert torch.equal(l2_norm(x, 1e-5), want)


def test_temperature_grows_every_floor_scale_tokens():
    # transformers: 1 + attn_scale * log1p(floor((p + 1) / floor_scale))
    tuning = AttnTemperature(floor_scale=4, attn_scale=0.5)
    scale = temperature_scale(torch.arange(12), tuning)
    assert scale.dtype == torch.float32
    steps = [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert scale.tolist() == pytest.approx([1 + 0.5 * math.log1p(s) for s in steps], abs=1e-7)


@pytest.mark.parametrize("top_k", [1, 2])
def test_input_scaled_moe_matches_transformers(top_k):
    hf_config = hf_text_config(num_experts_per_tok=top_k, hidden_size=64)
    theirs = llama4.Llama4TextMoe(hf_config).eval()
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for param in theirs.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    moe = MoEConfig(
        num_experts=4,
        top_k=top_k,
        expert_kind="swiglu",
        router_softmax="sigmoid",
        scale_input=True,
        intermediate_size=32,
        shared_expert_intermediate_size=32,
    )
    block = InputScaledMoEMLP(ours(mlp_kind="moe", moe=moe))  # fmt: skip
    assert isinstance(block.router, TopKRouter)
    state = llama4_expert_weights({f"mlp.{k}": v for k, v in theirs.state_dict().items()})
    block.load_state_dict({k.removeprefix("mlp."): v for k, v in state.items()})
    x = torch.randn(9, 64, generator=gen)
    want, router_logits = theirs(x)
    torch.testing.assert_close(block(x), want, rtol=0, atol=1e-5)
    weights, ids = block.router(x)  # the sigmoid of the chosen logits, not renormalised
    assert torch.equal(ids, router_logits.topk(top_k).indices)
    torch.testing.assert_close(weights, torch.sigmoid(router_logits.topk(top_k).values))


def test_config_translates_transformers_defaults():
    # no_rope_layers, layer_types and moe_layers derived as Llama4TextConfig does: NoPE (and
    # full attention) every 4th layer, MoE every 2nd layer from interleave_moe_layer_step=2
    hf = {key: value for key, value in config_json(num_hidden_layers=8).items()
          if key not in ("no_rope_layers", "layer_types", "moe_layers")}  # fmt: skip
    cfg = config_from_hf({**hf, "interleave_moe_layer_step": 2, "attention_chunk_size": 16})
    chunked, full = LayerKind.chunked(16), LayerKind.full()
    assert cfg.layer_kinds == (chunked, chunked, chunked, full) * 2
    assert cfg.nope_layers == (3, 7) and cfg.dense_mlp_layers == (0, 2, 4, 6)
    assert cfg.qk_l2_norm and cfg.attn_temperature == AttnTemperature(floor_scale=8192,
                                                                       attn_scale=0.1)  # fmt: skip
    assert cfg.intermediate_size == 96 and cfg.rope_theta == 500000.0 and cfg.head_size == 16
    assert cfg.moe == MoEConfig(num_experts=4, top_k=2, expert_kind="swiglu",
                                router_softmax="sigmoid", scale_input=True, intermediate_size=32,
                                shared_expert_intermediate_size=32)  # fmt: skip


def test_config_without_moe_layers_or_tuning():
    cfg = config_from_hf(config_json(num_hidden_layers=2, moe_layers=[], use_qk_norm=False,
                                     attn_temperature_tuning=False))  # fmt: skip
    assert cfg.mlp_kind == "swiglu" and cfg.moe is None and cfg.intermediate_size == 96
    assert not cfg.qk_l2_norm and cfg.attn_temperature is None


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (dict(no_rope_layers=[1, 2]), r"no_rope_layers must hold a 0 \(NoPE\) or 1 \(RoPE\) for "
                                      r"each of the 2 layers, got \[1, 2\]"),
        (dict(layer_types=["sliding_attention", "full_attention"]),
         r"layer_types must be 'chunked_attention' .* or 'full_attention', got "
         r"\['sliding_attention'\]"),
        (dict(attention_chunk_size=None, layer_types=["chunked_attention", "full_attention"]),
         r"here None\) or 'full_attention', got \['chunked_attention'\]"),
        (dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported, only 'silu'"),
        (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
         r"RoPE type 'dynamic' is not supported"),
    ],
)  # fmt: skip
def test_unsupported_config_values_are_named(edit, match):
    hf = {**config_json(num_hidden_layers=2), **edit}
    with pytest.raises(ValueError, match=match):
        config_from_hf(hf)


def test_model_config_refuses_bad_llama4_fields():
    with pytest.raises(ValueError, match=r"nope_layers \[1\] are outside the layers \[0, 1\)"):
        ours(nope_layers=[1])
    with pytest.raises(ValueError, match=r"rope_style must be one of .* got 'gptj'"):
        ours(rope_style="gptj")
    with pytest.raises(ValueError, match="scale_input needs expert_kind='swiglu'"):
        MoEConfig(num_experts=2, top_k=1, scale_input=True)
