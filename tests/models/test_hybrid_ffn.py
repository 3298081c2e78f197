"""`hybrid_ffn.HybridMoE` against transformers' Nemotron-H MoE, with a correction bias that
moves the choice (the engine parity tests save checkpoints whose bias is zero)."""

import pytest
import torch

from unified_attn.models.hybrid_config import HybridMoEConfig
from unified_attn.models.hybrid_ffn import HybridMoE, Relu2Experts

transformers = pytest.importorskip("transformers")
nemotron_h = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")


@pytest.mark.parametrize(("n_group", "topk_group", "norm"), [(1, 1, True), (4, 2, True),
                                                             (2, 1, False)])  # fmt: skip
def test_sigmoid_grouped_moe_matches_nemotron_h(n_group, topk_group, norm):
    hf_config = transformers.NemotronHConfig(
        hidden_size=32, n_routed_experts=8, num_experts_per_tok=3, n_group=n_group,
        topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5,
        moe_intermediate_size=24, moe_shared_expert_intermediate_size=40,
    )  # fmt: skip
    theirs = nemotron_h.NemotronHMoE(hf_config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor in theirs.state_dict().values():
            tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.3)
    moe = HybridMoEConfig(
        num_experts=8, top_k=3, intermediate_size=24, shared_intermediate_size=40,
        activation="relu2", routing="sigmoid_grouped", n_group=n_group, topk_group=topk_group,
        norm_topk_prob=norm, routed_scaling_factor=2.5,
    )  # fmt: skip
    ours = HybridMoE(32, moe, bias=False)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(1, 50, 32, generator=gen)
    with torch.no_grad():
        expected = theirs(x)[0]
        got = ours(torch.arange(50), x[0])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_relu2_experts_torch_path_is_transformers_loop_bit_for_bit(dtype):
    # only the routed experts' tokens, in transformers' order and rounding (off CUDA)
    hf_config = transformers.NemotronHConfig(
        hidden_size=64, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=48
    )
    theirs = nemotron_h.NemotronHExperts(hf_config).to(dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in theirs.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    ours = Relu2Experts(8, 64, 48).to(dtype)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(37, 64, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(7, generator=gen)[:3] for _ in range(37)])  # 7: unused
    weights = torch.rand(37, 3, generator=gen)
    with torch.no_grad():
        assert torch.equal(ours(x, weights, ids), theirs(x, ids, weights))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(top_k=5), "top_k=5 exceeds num_experts=4"),
        (dict(n_group=3), "num_experts=4 is not a multiple of n_group=3"),
        (dict(n_group=2, topk_group=3), "topk_group=3 exceeds n_group=2"),
        (dict(routing="sigmoid_grouped", n_group=4), "num_experts / n_group must be at least 2"),
        (dict(routing="softmax"), "routing must be one of"),
    ],
)
def test_moe_config_refuses(fields, message):
    with pytest.raises(ValueError, match=message):
        HybridMoEConfig(**{**dict(num_experts=4, top_k=2, intermediate_size=8), **fields})
