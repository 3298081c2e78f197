"""config.json readers of the state-space hybrids (`hybrid_hf.py`): what Granite-4.0-H and
Nemotron-H's MoE blocks read, and the values they refuse (engine parity on saved checkpoints:
tests/runner/test_engine_hf_parity.py)."""

import pytest

from unified_attn.models.hybrid_hf import hybrid_config_from_hf

GRANITE = dict(
    model_type="granitemoehybrid", vocab_size=128, hidden_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
    shared_intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
    layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_head="auto", mamba_n_groups=2,
    mamba_d_state=16, mamba_expand=2, hidden_act="silu", position_embedding_type="nope",
    embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
    logits_scaling=8.0,
)  # fmt: skip
NEMOTRON = dict(
    model_type="nemotron_h", vocab_size=128, hidden_size=64, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, intermediate_size=96, hybrid_override_pattern="ME*E",
    mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, n_routed_experts=8,
    num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=48, routed_scaling_factor=2.5, moe_latent_size=None,
)  # fmt: skip


def test_granite_reads_legacy_layer_types_and_multipliers():
    config = hybrid_config_from_hf(GRANITE)
    assert config.blocks == ("mamba", "moe", "attention", "moe")
    assert config.mamba.head_size == 16  # "auto": mamba_expand * hidden_size / mamba_n_heads
    assert config.rotary_dim is None
    assert config.attention_scale == 0.0078125
    assert (config.embedding_multiplier, config.residual_multiplier) == (12.0, 0.22)
    assert config.logits_scaling == 8.0
    assert config.moe is not None and config.moe.shared_intermediate_size == 48


def test_granite_without_experts_has_mlp_blocks():
    config = hybrid_config_from_hf({**GRANITE, "num_local_experts": 0})
    assert config.blocks == ("mamba", "mlp", "attention", "mlp")
    assert config.moe is None and config.intermediate_size == 48


def test_nemotron_reads_moe_blocks():
    config = hybrid_config_from_hf(NEMOTRON)
    assert config.blocks == ("mamba", "moe", "attention", "moe")
    assert config.moe is not None
    assert (config.moe.routing, config.moe.activation) == ("sigmoid_grouped", "relu2")
    assert (config.moe.n_group, config.moe.topk_group) == (2, 1)


@pytest.mark.parametrize(
    ("hf", "message"),
    [
        ({**GRANITE, "position_embedding_type": "alibi"},
         "position_embedding_type='alibi' is not supported; expected 'rope', 'nope' or null"),
        ({**GRANITE, "layer_types": ["mamba", "sliding_attention"]},
         "layer_types=.* is not supported"),
        ({**GRANITE, "hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({**NEMOTRON, "moe_latent_size": 16},
         "moe_latent_size=16 is not supported; expected None"),
        ({**NEMOTRON, "hybrid_override_pattern": "MX"}, r"blocks \['X'\] are not supported"),
    ],
)  # fmt: skip
def test_unsupported_values_are_refused(hf, message):
    with pytest.raises(ValueError, match=message):
        hybrid_config_from_hf(hf)
