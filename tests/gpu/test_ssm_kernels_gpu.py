"""GPU checks of the Mamba-2 kernels (`backends/triton/ssm_ops.py`) in bfloat16 at real shapes
(Nemotron-H-8B, Granite-4.0-H-Small) against `mamba_math`, and CUDA-graph capture of decode."""

import pytest
import torch

from tests.backends.test_ssm_triton import (
    conv_reference,
    int32,
    qsl_of,
    rel_err,
    scan_reference,
    ssd_inputs,
)
from unified_attn.backends import mamba_math
from unified_attn.backends.triton.ssm_ops import (
    causal_conv1d_update,
    causal_conv1d_varlen,
    ssd_scan_varlen,
    ssd_state_update,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# heads, head_dim, groups, state_dim, conv width, chunk_size
MODELS = {"nemotron_h_8b": (128, 64, 8, 128, 4, 128),
          "granite_4_h_small": (128, 64, 1, 128, 4, 256)}  # fmt: skip
BF16_TOL = 2e-2
LENGTHS = [1, 2, 300, 1000, 37]
OFFSETS = [0, 700, 100, 256, 5]
READS, WRITES = [-1, 2, 3, -1, 5], [1, 2, 6, 7, -1]
CHECKPOINTS = [[-1] * 8, [-1] * 8, [10, 11, 12, -1, -1, -1, -1, -1],
               [13, 14, 15, 16, 17, 18, 19, 20], [21, -1, -1, -1, -1, -1, -1, -1]]  # fmt: skip


@pytest.mark.parametrize("model", MODELS, ids=list(MODELS))
def test_scan_bf16_matches_mamba_math_at_real_shapes(model):
    heads, head_dim, groups, state_dim, _, chunk = MODELS[model]
    inp = ssd_inputs(sum(LENGTHS), heads, head_dim, groups, state_dim, torch.bfloat16, seed=0)
    states = torch.randn(24, heads, head_dim, state_dim, device="cuda") * 0.1
    limit = (0.0, float("inf"))
    want_y, want_states = scan_reference(inp, LENGTHS, OFFSETS, states, READS, WRITES, chunk,
                                         limit, CHECKPOINTS)  # fmt: skip
    y = ssd_scan_varlen(**inp, query_start_loc=qsl_of(LENGTHS), offsets=int32(OFFSETS),
                        ssm_states=states, read_slots=int32(READS), write_slots=int32(WRITES),
                        chunk_size=chunk, checkpoint_slots=int32(CHECKPOINTS))  # fmt: skip
    assert rel_err(y, want_y) < BF16_TOL
    assert rel_err(states, want_states) < BF16_TOL


@pytest.mark.parametrize("model", MODELS, ids=list(MODELS))
def test_conv_bf16_matches_mamba_math_at_real_shapes(model):
    heads, head_dim, groups, state_dim, width, _ = MODELS[model]
    channels = heads * head_dim + 2 * groups * state_dim
    x = torch.randn(sum(LENGTHS), channels, device="cuda").to(torch.bfloat16)
    states = torch.randn(8, width - 1, channels, device="cuda").to(torch.bfloat16)
    weight = (torch.randn(channels, width, device="cuda") / width).to(torch.bfloat16)
    bias = torch.randn(channels, device="cuda").to(torch.bfloat16)
    want_y, want_states = conv_reference(x, LENGTHS, states, READS, WRITES, weight, bias)
    y = causal_conv1d_varlen(x, qsl_of(LENGTHS), states, int32(READS), int32(WRITES), weight,
                             bias)  # fmt: skip
    assert rel_err(y, want_y) < BF16_TOL
    assert rel_err(states, want_states) < BF16_TOL


def decode_step(inp, pool, conv_in, conv_states, weight, slots):
    conv_out = causal_conv1d_update(conv_in, conv_states, slots, slots, weight, None)
    y = ssd_state_update(**inp, ssm_states=pool, read_slots=slots, write_slots=slots)
    return conv_out, y


@pytest.mark.parametrize("model", MODELS, ids=list(MODELS))
@pytest.mark.parametrize("batch", [1, 256])
def test_decode_bf16_matches_mamba_math_and_replays_from_a_cuda_graph(model, batch):
    heads, head_dim, groups, state_dim, width, _ = MODELS[model]
    inp = ssd_inputs(batch, heads, head_dim, groups, state_dim, torch.bfloat16, seed=batch)
    pool = torch.randn(batch + 2, heads, head_dim, state_dim, device="cuda") * 0.1
    slots = torch.randperm(batch + 2, device="cuda")[:batch].int()
    channels = heads * head_dim + 2 * groups * state_dim
    conv_in = torch.randn(batch, channels, device="cuda").to(torch.bfloat16)
    conv_states = torch.randn(batch + 2, width - 1, channels, device="cuda").to(torch.bfloat16)
    weight = torch.randn(channels, width, device="cuda").to(torch.bfloat16)

    dt = mamba_math.discretize(inp["dt"], inp["dt_bias"], (0.0, float("inf")))
    before = pool[slots.long()].clone()
    want_y, want_state = mamba_math.ssd_step(inp["x"], dt, inp["A"], inp["B"], inp["C"], before)
    want_y = want_y + inp["D"][:, None] * inp["x"].float()
    conv_before = conv_states.clone()
    want_conv, _ = conv_reference(conv_in, [1] * batch, conv_states, slots.tolist(),
                                  slots.tolist(), weight, None)  # fmt: skip

    eager_conv, eager_y = decode_step(inp, pool, conv_in, conv_states, weight, slots)
    assert rel_err(eager_y, want_y) < BF16_TOL
    assert rel_err(pool[slots.long()], want_state) < BF16_TOL
    assert rel_err(eager_conv, want_conv) < BF16_TOL

    pool_after, conv_after = pool.clone(), conv_states.clone()
    pool[slots.long()] = before
    conv_states.copy_(conv_before)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        graph_conv, graph_y = decode_step(inp, pool, conv_in, conv_states, weight, slots)
    pool[slots.long()] = before  # the capture may have run nothing; replay from the start
    conv_states.copy_(conv_before)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_y, eager_y)
    assert torch.equal(graph_conv, eager_conv)
    assert torch.equal(pool, pool_after)
    assert torch.equal(conv_states, conv_after)
