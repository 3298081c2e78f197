"""ModelConfig / LayerKind / RopeScaling validation and defaults."""

import attrs
import pytest

from unified_attn.models import LayerKind, ModelConfig, MoEConfig, RopeScaling

BASE = dict(
    vocab_size=100, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2
)


def test_defaults_head_size_and_all_full_layers():
    cfg = ModelConfig(**BASE)
    assert cfg.head_size == 16
    assert cfg.layer_kinds == (LayerKind.full(), LayerKind.full())
    assert cfg.eos_token_ids == ()


def test_layer_kinds_list_and_eos_list_become_tuples_and_config_is_hashable():
    cfg = ModelConfig(**BASE, layer_kinds=[LayerKind.sliding(8)] * 2, eos_token_id=[3, 4])
    assert cfg.layer_kinds == (LayerKind.sliding(8),) * 2
    assert cfg.eos_token_ids == (3, 4)
    assert hash(cfg) == hash(attrs.evolve(cfg))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(layer_kinds=(LayerKind.full(),)), "1 layer_kinds for num_layers=2"),
        (dict(num_kv_heads=3), "not a multiple"),
        (dict(head_size=15), "even head_size"),
        (dict(eos_token_id=100), "outside the vocabulary"),
        (dict(hidden_size=0), "hidden_size must be a positive int"),
    ],
)
def test_invalid_model_config(overrides, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**BASE, **overrides})


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(kind="sliding"),
        dict(kind="sliding", window=4, chunk=4),
        dict(kind="chunked", window=4),
        dict(kind="full", window=4),
        dict(kind="sliding", window=0),
        dict(kind="dilated", window=4),
    ],
)
def test_invalid_layer_kind(kwargs):
    with pytest.raises(ValueError):
        LayerKind(**kwargs)


def test_invalid_rope_scaling():
    with pytest.raises(ValueError, match="high_freq_factor > low_freq_factor"):
        RopeScaling(factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0)
    with pytest.raises(ValueError, match="rope_type"):
        RopeScaling(rope_type="dynamic", factor=2.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(mlp_kind="moe"), "mlp_kind='moe' needs a MoEConfig"),
        (dict(moe=MoEConfig(num_experts=4, top_k=2)), "mlp_kind='swiglu' with moe="),
        (dict(mlp_kind="relu"), "mlp_kind must be one of"),
        (dict(norm_style="layernorm"), "norm_style must be one of"),
        (dict(attn_logit_softcap=0.0), "attn_logit_softcap must be a positive number"),
        (dict(final_logit_softcap=-1.0), "final_logit_softcap must be a positive number"),
        (dict(query_pre_attn_scalar=0), "query_pre_attn_scalar must be a positive number"),
        (dict(dense_mlp_layers=(0,)), "only mlp_kind='moe' has dense layers"),
        (
            dict(mlp_kind="moe", moe=MoEConfig(num_experts=4, top_k=2), dense_mlp_layers=[2]),
            r"dense_mlp_layers \[2\] are outside the layers \[0, 2\)",
        ),
        (
            dict(local_rope_scaling=RopeScaling(rope_type="linear", factor=2.0)),
            "local_rope_scaling without local_rope_theta",
        ),
        (dict(local_rope_theta=0.0), "local_rope_theta must be a positive number"),
    ],
)
def test_invalid_family_features(overrides, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**BASE, **overrides})


def test_invalid_moe_config():
    with pytest.raises(ValueError, match="top_k=5 exceeds num_experts=4"):
        MoEConfig(num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="expert_kind must be one of"):
        MoEConfig(num_experts=4, top_k=2, expert_kind="relu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="router_softmax must be one of"):
        MoEConfig(num_experts=4, top_k=2, router_softmax="sparsemax")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="intermediate_size must be a positive int"):
        MoEConfig(num_experts=4, top_k=2, intermediate_size=0)


def test_local_rope_applies_to_window_and_chunk_layers_only():
    cfg = ModelConfig(**BASE, local_rope_theta=500.0)
    assert cfg.rope_of(LayerKind.sliding(8)) == (500.0, None)
    assert cfg.rope_of(LayerKind.chunked(8)) == (500.0, None)
    assert cfg.rope_of(LayerKind.full()) == (10000.0, None)
    assert ModelConfig(**BASE).rope_of(LayerKind.sliding(8)) == (10000.0, None)


def test_attention_scale_and_sinks_flag():
    assert ModelConfig(**BASE).attention_scale == 16**-0.5
    assert ModelConfig(**BASE, query_pre_attn_scalar=256).attention_scale == 256**-0.5
    sliding = LayerKind.sliding(8, has_sinks=True)
    assert sliding.has_sinks and sliding != LayerKind.sliding(8)
    assert not LayerKind.full().has_sinks


def test_yarn_rope_scaling_is_accepted():
    scaling = RopeScaling(rope_type="yarn", factor=32.0, original_max_position_embeddings=4096)
    assert (scaling.beta_fast, scaling.beta_slow, scaling.truncate) == (32.0, 1.0, True)
