"""Qwen3-Next's config: what `config.json` translates to, what is refused (naming the field),
and the real model's cache plan."""

import pytest

from tests.models.hf_models import make_family_model, save_hf_model
from unified_attn.harness.capacity import REAL_SHAPES, capacity
from unified_attn.models import LayerKind, ModelConfig
from unified_attn.models.families import family_of
from unified_attn.models.gated_delta_config import GatedDeltaConfig
from unified_attn.models.hf import config_from_hf, read_hf_config

GIB = 2**30


@pytest.fixture(scope="module")
def hf_config(tmp_path_factory):
    path = save_hf_model(make_family_model("qwen3-next"), tmp_path_factory.mktemp("qwen3-next"))
    return read_hf_config(path)


def test_config_json_translates(hf_config):
    config = config_from_hf(hf_config)
    kinds = [kind.kind for kind in config.layer_kinds]
    assert kinds == ["gated_delta", "full", "gated_delta", "gated_delta"]
    assert config.gated_delta == GatedDeltaConfig(num_k_heads=2, num_v_heads=4, k_head_size=16,
                                                  v_head_size=16, conv_kernel=4)  # fmt: skip
    assert (config.rotary_dim, config.attn_output_gate, config.norm_style) == (8, True, "gemma")
    assert config.moe is not None and config.moe.shared_expert_intermediate_size == 48


@pytest.mark.parametrize("field,value,message", [
    ("layer_types", ["linear_attention", "sliding_attention", "full_attention",
                     "full_attention"], "layer_types must be 4 of"),
    ("hidden_act", "gelu", "hidden_act='gelu' is not supported"),
    ("linear_num_value_heads", 3, "num_v_heads=3 is not a multiple of num_k_heads=2"),
])  # fmt: skip
def test_unsupported_values_are_refused(hf_config, field, value, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf({**hf_config, field: value})


def test_model_config_checks_its_fields():
    base = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                num_kv_heads=1, head_size=16)  # fmt: skip
    with pytest.raises(ValueError, match="gated_delta layers need a GatedDeltaConfig"):
        ModelConfig(**base, layer_kinds=[LayerKind.gated_delta()])
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0\.1 gives 1 of 16 channels"):
        ModelConfig(**base, partial_rotary_factor=0.1)


def test_a_rank_keeps_its_key_heads_with_their_value_heads():
    """Engine parity with 2 ranks: tests/runner/test_tensor_parallel_state.py."""
    config = REAL_SHAPES["qwen3-next-80b-a3b"]
    local = family_of(config).shard_config(config, 4)
    assert local.gated_delta == GatedDeltaConfig(num_k_heads=4, num_v_heads=8, k_head_size=128,
                                                 v_head_size=128, conv_kernel=4)  # fmt: skip
    assert (local.num_heads, local.num_kv_heads, local.attn_output_gate) == (4, 1, True)


def test_real_model_plan_holds_one_state_per_gated_delta_layer():
    cap = capacity(REAL_SHAPES["qwen3-next-80b-a3b"], 40 * GIB, 32768, max_in_flight_tokens=2048)
    states = [g for g in cap.plan.groups if g.manager_cls.__name__ == "StateManager"]
    assert sum(len(g.layers) for g in states) == 36
    # [3, 32 * 128 + 2 * 16 * 128] bf16 convolution inputs + [32, 128, 128] float32 state
    state_bytes = 3 * 8192 * 2 + 32 * 128 * 128 * 4
    assert all(g.page_bytes() == len(g.layers) * state_bytes for g in states)
