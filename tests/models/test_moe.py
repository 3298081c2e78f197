"""Mixtures of experts against transformers: GPT-OSS's GptOssMLP (eager and grouped experts),
Mixtral's and Qwen2-MoE's sparse MoE blocks (softmax over all experts, shared expert)."""

import attrs
import pytest
import torch

from unified_attn.models import ModelConfig, MoEConfig
from unified_attn.models.moe import MoEMLP, SparseMoEMLP

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


# ---- Mixtral and Qwen2-MoE ----------------------------------------------------------------------

SPARSE = dict(hidden_size=64, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)


def hf_sparse_block(kind: str, dtype: torch.dtype, seed: int = 0, **overrides):
    if kind == "mixtral":
        module = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
        config = transformers.MixtralConfig(
            **SPARSE, num_local_experts=5, num_experts_per_tok=2, **overrides
        )
        block = module.MixtralSparseMoeBlock(config)
    else:
        module = pytest.importorskip("transformers.models.qwen2_moe.modeling_qwen2_moe")
        config = transformers.Qwen2MoeConfig(
            **SPARSE,
            num_experts=5,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=40,
            **overrides,
        )
        block = module.Qwen2MoeSparseMoeBlock(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return block.to(dtype)


def our_sparse_block(kind: str, dtype: torch.dtype, norm_topk_prob: bool = True):
    shared = 40 if kind == "qwen2_moe" else None
    moe = MoEConfig(
        num_experts=5,
        top_k=2,
        expert_kind="swiglu",
        router_softmax="all",
        norm_topk_prob=norm_topk_prob,
        routing_weights_dtype="model" if kind == "qwen2_moe" else "float32",
        shared_expert_intermediate_size=shared,
    )
    return SparseMoEMLP(attrs.evolve(OURS, mlp_kind="moe", moe=moe)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("kind", "overrides"),
    [
        ("mixtral", {}),
        ("qwen2_moe", dict(norm_topk_prob=False)),
        ("qwen2_moe", dict(norm_topk_prob=True)),
    ],
)
def test_sparse_moe_matches_transformers(kind, overrides, dtype):
    theirs = hf_sparse_block(kind, dtype, **overrides)
    ours = our_sparse_block(kind, dtype, overrides.get("norm_topk_prob", True))
    ours.load_state_dict(theirs.state_dict())  # transformers 5 stacks the experts too
    x = torch.randn(1, 37, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        expected = theirs(x)
        expected = (expected[0] if isinstance(expected, tuple) else expected)[0]
        got = ours(x[0])
    # fused (theirs) and separate (ours) gate/up matmuls may round differently: close, not equal
    torch.testing.assert_close(got, expected)


def test_softmax_over_all_experts_then_top_k():
    mlp = our_sparse_block("mixtral", torch.float32, norm_topk_prob=False)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    weights, ids = mlp.gate(x)
    probs = torch.softmax(x @ mlp.gate.weight.T, -1)
    torch.testing.assert_close(weights, probs.gather(-1, ids))  # not renormalised
    assert weights.dtype == torch.float32 and (weights.sum(-1) < 1).all()
    renormed = our_sparse_block("mixtral", torch.float32, norm_topk_prob=True)
    renormed.load_state_dict(mlp.state_dict())
    torch.testing.assert_close(renormed.gate(x)[0].sum(-1), torch.ones(3))


def test_routing_weights_dtype():
    # Mixtral weights the experts in float32, Qwen2-MoE rounds the weights to the model dtype.
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6)).bfloat16()
    for kind, dtype in [("mixtral", torch.float32), ("qwen2_moe", torch.bfloat16)]:
        mlp = our_sparse_block(kind, torch.bfloat16)
        with torch.no_grad():
            mlp.gate.weight.normal_(generator=torch.Generator().manual_seed(7))
        weights, _ = mlp.gate(x)
        assert weights.dtype == dtype, kind


def test_shared_expert_is_gated_by_a_sigmoid():
    mlp = our_sparse_block("qwen2_moe", torch.float32)
    assert mlp.shared_expert is not None and mlp.shared_expert_gate is not None
    with torch.no_grad():
        for param in mlp.parameters():
            param.normal_(generator=torch.Generator().manual_seed(param.numel()))
        mlp.shared_expert_gate.weight.zero_()  # sigmoid(0) = 1/2
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    shared = mlp.shared_expert(x)
    with_shared = mlp(x)
    mlp.shared_expert_gate.weight.data.fill_(-1e4)  # sigmoid -> 0: the shared expert is off
    torch.testing.assert_close(with_shared - mlp(x), shared / 2, atol=1e-4, rtol=1e-4)
