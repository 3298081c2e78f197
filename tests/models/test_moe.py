"""The GPT-OSS mixture of experts against transformers' GptOssMLP (eager and grouped experts)."""

import attrs
import pytest
import torch

from unified_attn.models import ModelConfig, MoEConfig
from unified_attn.models.moe import MoEMLP

gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
transformers = pytest.importorskip("transformers")

OURS = ModelConfig(
    vocab_size=8,
    hidden_size=64,
    intermediate_size=48,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    mlp_kind="moe",
    moe=MoEConfig(num_experts=5, top_k=2),
)


def hf_mlp(experts: str, dtype: torch.dtype, seed: int = 0):
    config = transformers.GptOssConfig(
        hidden_size=64,
        intermediate_size=48,
        num_local_experts=5,
        num_experts_per_tok=2,
        experts_implementation=experts,
    )
    mlp = gpt_oss.GptOssMLP(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in mlp.named_parameters():
            # gate/up values of several units reach the clamp at 7
            std = 0.5 if name == "experts.gate_up_proj" else 0.3
            param.copy_(torch.randn(param.shape, generator=gen) * std)
    return mlp.to(dtype)


@pytest.mark.parametrize("experts", ["eager", "grouped_mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_matches_gpt_oss(experts, dtype):
    theirs = hf_mlp(experts, dtype)
    ours = MoEMLP(OURS).to(dtype)
    ours.load_state_dict(theirs.state_dict())
    x = (torch.randn(1, 37, 64, generator=torch.Generator().manual_seed(1)) * 2).to(dtype)
    with torch.no_grad():
        expected = theirs(x)[0][0]
        gate_up = x[0] @ theirs.experts.gate_up_proj[0]
        got = ours(x[0])
    assert (gate_up.abs() > 7).any()  # the clamp is exercised
    torch.testing.assert_close(got, expected)  # bitwise equal on CPU today


def test_router_softmax_over_top_k_only():
    mlp = MoEMLP(attrs.evolve(OURS, moe=MoEConfig(num_experts=4, top_k=2)))
    with torch.no_grad():
        mlp.router.bias.copy_(torch.tensor([0.0, 3.0, 1.0, 2.0]))
    weights, ids = mlp.router(torch.zeros(3, 64))
    assert ids.tolist() == [[1, 3]] * 3
    torch.testing.assert_close(weights[0], torch.softmax(torch.tensor([3.0, 2.0]), -1))


def test_unchosen_experts_contribute_nothing():
    mlp = MoEMLP(OURS)
    with torch.no_grad():
        mlp.router.bias.copy_(torch.tensor([5.0, 4.0, 0.0, 0.0, 0.0]))  # experts 0 and 1 chosen
        mlp.experts.down_proj_bias[2:].fill_(1e30)  # would swamp the output if added
        mlp.experts.down_proj_bias[:2].fill_(1.0)
    assert torch.equal(mlp(torch.zeros(4, 64)), torch.ones(4, 64))
