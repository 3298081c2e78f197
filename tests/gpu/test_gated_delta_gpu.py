"""GPU checks of the gated delta rule's kernels (`backends/triton/gated_delta_ops.py`) in bfloat16
at Qwen3-Next-80B's shapes against `gated_delta_math`, CUDA-graph capture of decode, and the
tiny Qwen3-Next on CUDA in float32 (the kernels in eager prefill, with "all" mode's
checkpoints, and in decode steps replayed from CUDA graphs): transformers' greedy tokens and
logits, and our CPU torch path's logits."""

from __future__ import annotations

import pytest
import torch

from tests.backends.test_gated_delta_triton import kernel_qk, rule_inputs, varlen_reference
from tests.backends.test_ssm_triton import int32, qsl_of, rel_err
from tests.gpu.test_hybrid_gpu import PROMPTS, check
from tests.models.hf_models import make_family_model, save_hf_model
from unified_attn import LLMEngine, SamplingParams
from unified_attn.backends import gated_delta_math
from unified_attn.backends.triton.gated_delta_ops import (
    gated_delta_chunked_varlen,
    gated_delta_update,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HK, HV, DK, DV = 16, 32, 128, 128  # Qwen3-Next-80B-A3B
BF16_TOL = 2e-2
LENGTHS = [1, 2, 300, 1000, 37]
OFFSETS = [0, 700, 100, 256, 5]
READS, WRITES = [-1, 2, 3, -1, 5], [1, 2, 6, 7, -1]
CHECKPOINTS = [[-1] * 8, [-1] * 8, [10, 11, 12, -1, -1, -1, -1, -1],
               [13, 14, 15, 16, 17, 18, 19, 20], [21, -1, -1, -1, -1, -1, -1, -1]]  # fmt: skip


@pytest.mark.parametrize("l2norm", [True, False])
def test_varlen_bf16_matches_gated_delta_math_at_real_shapes(l2norm):
    inp = rule_inputs(sum(LENGTHS), HK, HV, DK, DV, torch.bfloat16, seed=0)
    states = torch.randn(24, HV, DK, DV, device="cuda") * 0.1
    want_o, want_states = varlen_reference(inp, LENGTHS, OFFSETS, states, READS, WRITES, 64,
                                           CHECKPOINTS)  # fmt: skip
    q, k, scale = kernel_qk(inp, l2norm)
    o = gated_delta_chunked_varlen(q, k, inp["v"], inp["g"], inp["beta"], qsl_of(LENGTHS),
                                   int32(OFFSETS), states, int32(READS), int32(WRITES), scale,
                                   64, int32(CHECKPOINTS), l2norm=l2norm)  # fmt: skip
    assert rel_err(o, want_o) < BF16_TOL
    assert rel_err(states, want_states) < BF16_TOL


@pytest.mark.parametrize("batch", [1, 256])
def test_decode_bf16_matches_gated_delta_math_and_replays_from_a_cuda_graph(batch):
    inp = rule_inputs(batch, HK, HV, DK, DV, torch.bfloat16, seed=batch)
    pool = torch.randn(batch + 2, HV, DK, DV, device="cuda") * 0.1
    slots = torch.randperm(batch + 2, device="cuda")[:batch].int()
    before = pool[slots.long()].clone()
    q, k = gated_delta_math.prepare_qk(inp["q"], inp["k"], HV)
    want_o, want_state = gated_delta_math.gated_delta_step(q, k, inp["v"], inp["g"],
                                                           inp["beta"], before)  # fmt: skip

    def step():
        return gated_delta_update(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool,
                                  slots, slots, DK**-0.5, l2norm=True)  # fmt: skip

    eager_o = step()
    assert rel_err(eager_o, want_o) < BF16_TOL
    assert rel_err(pool[slots.long()], want_state) < BF16_TOL
    pool_after = pool.clone()
    pool[slots.long()] = before
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        graph_o = step()
    pool[slots.long()] = before  # the capture may have run nothing; replay from the start
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_o, eager_o)
    assert torch.equal(pool, pool_after)


def engine(path, device, mode, **options):
    return LLMEngine(str(path), device=device, dtype="float32", max_num_seqs=4,
                     max_model_len=128, kv_cache_memory="64MiB", max_num_batched_tokens=48,
                     mamba_cache_mode=mode, **options)  # fmt: skip


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    hf = make_family_model("qwen3-next")
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("qwen3-next"))


@pytest.mark.parametrize("mode", ["align", "all", "none"])
def test_kernels_give_transformers_tokens_and_our_cpu_logits(qwen3_next, mode):
    hf, path = qwen3_next
    gpu, cpu = engine(path, "cuda", mode), engine(path, "cpu", mode)
    params = SamplingParams(max_tokens=12, ignore_eos=True, return_logits=True)
    for batch in (PROMPTS[:1], PROMPTS[1:]):
        outputs = gpu.generate(batch, params)
        check(hf, batch, outputs)
        for ours, reference in zip(outputs, cpu.generate(batch, params), strict=True):
            assert ours.output_token_ids == reference.output_token_ids
            torch.testing.assert_close(torch.stack(list(ours.logits)).float().cpu(),
                                       torch.stack(list(reference.logits)).float(),
                                       rtol=1e-3, atol=1e-3)  # fmt: skip
    assert gpu.runner.graphs is not None and gpu.runner.graphs.num_replays > 0
    cached = [o.num_cached_tokens for o in outputs]
    assert (sum(cached) == 0) == (mode == "none"), cached


def test_speculation_over_gated_delta_layers_on_the_gpu(qwen3_next):
    """n-gram drafts: verify steps save a state per token through the varlen kernel."""
    hf, path = qwen3_next
    gpu = engine(path, "cuda", "none", speculative_method="ngram", num_speculative_tokens=3)
    prompts = [PROMPTS[0][:9] * 4, PROMPTS[3]]
    check(hf, prompts, gpu.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True,
                                                            return_logits=True)))  # fmt: skip
    assert gpu.stats.spec_drafted > 0
