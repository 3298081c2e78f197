"""The grouped experts kernels on the GPU (run through the device tool): bf16 at real widths
against a float32 sum over each token's chosen experts, in decode and prefill token counts, for
SwiGLU and Nemotron-H's ungated relu2 experts, and a CUDA graph replay (the routing sorted on
the device, no host sync) giving the eager result."""

from __future__ import annotations

import pytest
import torch

from unified_attn.kernels.moe.grouped_experts import grouped_experts
from unified_attn.models.hybrid_ffn import Relu2Experts
from unified_attn.models.moe import RoutedExperts, StackedExperts, swiglu

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _case(num, k, hidden, inter, tokens, limit=None, relu2=False):
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    plain: StackedExperts = (
        Relu2Experts(num, hidden, inter) if relu2 else RoutedExperts(num, hidden, inter, limit)
    )
    experts = plain.to("cuda", torch.bfloat16)
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(0.0, param.shape[-1] ** -0.5, generator=gen)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
    ids = torch.rand(tokens, num, device="cuda", generator=gen).argsort(dim=1)[:, :k]
    weights = torch.rand(tokens, k, device="cuda", generator=gen).softmax(dim=1)
    return experts, x, weights, ids


def _exact(experts, x, weights, ids):
    out = torch.zeros(x.shape, device="cuda")
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            gate, up = (experts.gate_up_proj[e].float() @ x[t].float()).chunk(2)
            out[t] += weights[t, j] * (
                experts.down_proj[e].float() @ swiglu(gate, up, experts.limit)
            )
    return out


def _exact_relu2(experts, x, weights, ids):
    out = torch.zeros(x.shape, device="cuda")
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            hidden = torch.relu(experts.up_proj[e].float() @ x[t].float()).square()
            out[t] += weights[t, j] * (experts.down_proj[e].float() @ hidden)
    return out


@pytest.mark.parametrize(("num", "k", "hidden", "inter", "tokens", "limit"),
                         [(64, 6, 2048, 1408, 1, None), (64, 6, 2048, 1408, 37, 7.0),
                          (16, 2, 1024, 512, 300, None)])  # fmt: skip
def test_bf16_kernels_match_a_float32_sum(num, k, hidden, inter, tokens, limit):
    experts, x, weights, ids = _case(num, k, hidden, inter, tokens, limit)
    got = experts(x, weights, ids)  # CUDA: the grouped kernels
    want = _exact(experts, x, weights, ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0.02, atol=0.02 * want.abs().max().item())
    dense = experts.reference(x, weights, ids)  # the dense form in bf16: the same tolerance
    torch.testing.assert_close(dense.float(), want, rtol=0.02, atol=0.02 * want.abs().max().item())


# Nemotron-3-Nano's experts (128, 6 chosen, 2688 -> 1856), then a small prefill
@pytest.mark.parametrize(("num", "k", "hidden", "inter", "tokens"),
                         [(128, 6, 2688, 1856, 1), (128, 6, 2688, 1856, 37),
                          (16, 2, 1024, 512, 300)])  # fmt: skip
def test_bf16_relu2_kernels_match_a_float32_sum(num, k, hidden, inter, tokens):
    experts, x, weights, ids = _case(num, k, hidden, inter, tokens, relu2=True)
    got = experts(x, weights, ids)  # CUDA: the grouped kernels, ungated
    want = _exact_relu2(experts, x, weights, ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0.02, atol=0.02 * want.abs().max().item())
    torch_path = experts.reference(x, weights, ids)  # transformers' loop in bf16
    torch.testing.assert_close(torch_path.float(), want, rtol=0.02,
                               atol=0.02 * want.abs().max().item())  # fmt: skip


@pytest.mark.parametrize("relu2", [False, True], ids=["swiglu", "relu2"])
def test_a_graph_replay_gives_the_eager_sum(relu2):
    experts, x, weights, ids = _case(32, 4, 512, 256, 8, relu2=relu2)
    eager = grouped_experts(x, weights, ids, *experts.kernel_weights())
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        grouped_experts(x, weights, ids, *experts.kernel_weights())  # compile
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped_experts(x, weights, ids, *experts.kernel_weights())
    fresh = _case(32, 4, 512, 256, 9, relu2=relu2)  # new routing and inputs into the buffers
    x.copy_(fresh[1][:8]), weights.copy_(fresh[2][:8]), ids.copy_(fresh[3][:8])
    graph.replay()
    torch.cuda.synchronize()
    want = grouped_experts(x, weights, ids, *experts.kernel_weights())
    assert torch.equal(out, want) and not torch.equal(out, eager)
