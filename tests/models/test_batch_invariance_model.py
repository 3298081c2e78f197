"""Batch-invariant mode's switch and model pieces: the module swap, what the mode refuses,
the MoE block and the token-by-token linear-state recurrence."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from tests.models.prefill import PagedRunner
from unified_attn import LLMEngine, SamplingParams
from unified_attn.backends.linear_state import gated_linear_attention, gated_linear_recurrence
from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.models import MLA_PRESETS, PRESETS, DecoderModel, DeepseekForCausalLM
from unified_attn.models.invariant import (
    batch_invariance_problems,
    make_batch_invariant,
    require_batch_invariant,
)
from unified_attn.models.invariant.model import (
    InvariantExperts,
    InvariantLinear,
    InvariantRMSNorm,
    InvariantTopKRouter,
)
from unified_attn.models.moe import make_moe
from unified_attn.request import Request
from unified_attn.runner.sampler import Sampler

INVARIANT = {"batch_invariant": True}


def model(preset: str, **options) -> DecoderModel:
    m = DecoderModel(PRESETS[preset], ReferenceAttentionBackend, backend_options=options or None)
    m.init_random_weights(0)
    return m


def test_the_mode_swaps_every_matmul_norm_and_router():
    m = model("gpt-oss-like", **INVARIANT)
    kinds = {type(module) for module in m.modules()}
    assert {InvariantLinear, InvariantRMSNorm, InvariantTopKRouter, InvariantExperts} <= kinds
    assert nn.Linear not in kinds and m.batch_invariant
    assert batch_invariance_problems(m) == []
    assert all(backend.batch_invariant for _, backend in m.attention_layers())


def test_the_swap_keeps_parameter_names_and_values():
    plain, invariant = model("gpt-oss-like"), model("gpt-oss-like", **INVARIANT)
    ours, theirs = plain.state_dict(), invariant.state_dict()
    assert list(ours) == list(theirs)
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_the_invariant_model_stays_close_to_the_plain_one():
    prompt = list(range(1, 30))
    logits = [
        PagedRunner(model("gpt-oss-like", **options), 1, 32).step([prompt])
        for options in ({}, INVARIANT)
    ]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


def test_a_plain_model_is_reported():
    (problem,) = batch_invariance_problems(model("tiny-llama"))
    assert "DecoderModel has no batch-invariant mode" in problem


def test_an_unknown_module_is_reported_by_name():
    m = model("tiny-llama", **INVARIANT)
    m.model.layers[1].mlp.down_proj = nn.Bilinear(4, 4, 4)
    (problem,) = batch_invariance_problems(m)
    assert problem.startswith("model.layers.1.mlp.down_proj is a Bilinear")


def test_a_subclass_of_a_swapped_class_is_not_trusted():
    class Sharded(nn.Linear):
        pass

    m = model("tiny-llama")
    m.model.layers[0].self_attn.o_proj = Sharded(128, 128)
    make_batch_invariant(m)
    assert type(m.model.layers[0].self_attn.o_proj) is Sharded
    assert any("is a Sharded" in p for p in batch_invariance_problems(m))


def test_a_backend_outside_invariant_mode_is_reported():
    m = model("tiny-llama")
    make_batch_invariant(m)  # modules only: the backends were built without the mode
    problems = batch_invariance_problems(m)
    assert len(problems) == 4 and "not in batch-invariant mode" in problems[0]


def test_other_model_families_are_refused():
    from unified_attn.backends.mla import MLAReferenceBackend

    deepseek = DeepseekForCausalLM(MLA_PRESETS["deepseek-v3-like"], MLAReferenceBackend)
    with pytest.raises(ValueError, match="DeepseekForCausalLM has no batch-invariant mode"):
        require_batch_invariant(deepseek)


def test_the_engine_refuses_tensor_parallelism_before_starting_ranks():
    with pytest.raises(ValueError, match="tensor_parallel_size=2: row-parallel layers"):
        LLMEngine("tiny-llama", batch_invariant=True, tensor_parallel_size=2)


def test_the_environment_variable_turns_the_whole_model_invariant(monkeypatch):
    monkeypatch.setenv("UNIFIED_ATTN_BATCH_INVARIANT", "1")
    engine = LLMEngine("tiny-llama")
    assert engine.batch_invariant and engine.model.batch_invariant
    assert engine.runner.sampler.log_softmax is not Sampler(torch.device("cpu")).log_softmax


def test_invariant_sampler_log_probabilities_of_a_row_ignore_the_batch():
    logits = torch.randn(9, 4096, generator=torch.Generator().manual_seed(0)) * 4
    requests = [
        Request(f"r{i}", [1, 2], sampling_params=SamplingParams(logprobs=5)) for i in range(9)
    ]
    sampler = Sampler(torch.device("cpu"), batch_invariant=True)
    alone = sampler.sample(logits[:1], requests[:1]).logprobs[0]
    assert all(sampler.sample(logits[:m], requests[:m]).logprobs[0] == alone for m in (2, 5, 9))
    plain = Sampler(torch.device("cpu")).sample(logits[:1], requests[:1]).logprobs[0]
    assert plain is not None and alone is not None and alone.token_id == plain.token_id
    assert alone.logprob == pytest.approx(plain.logprob, abs=1e-5)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_keep_elementwise_rows_a_multiple_of_16_floats(preset):
    """The CPU path's condition for element-wise ops (docs/batch-invariance.md): every
    activation and RoPE row fills whole vectors, so torch's scalar tail never touches it."""
    config = PRESETS[preset]
    widths = [config.hidden_size, config.intermediate_size, config.head_size, config.vocab_size]
    if config.moe is not None:
        widths.append(config.moe.intermediate_size or config.intermediate_size)
    assert all(w % 16 == 0 for w in widths), widths


# ---- MoE -------------------------------------------------------------------------------------


def test_moe_rows_do_not_depend_on_the_batch_and_stay_close():
    config = PRESETS["gpt-oss-like"]
    plain = make_moe(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in plain.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    invariant = make_batch_invariant(make_moe(config))
    invariant.load_state_dict(plain.state_dict())
    x = torch.randn(64, config.hidden_size, generator=gen)
    with torch.no_grad():
        alone = invariant(x[:1])[0]
        assert all(torch.equal(invariant(x[:m])[0], alone) for m in range(2, 65))
        torch.testing.assert_close(invariant(x), plain(x), rtol=1e-4, atol=1e-3)


def test_router_row_sums_add_left_to_right():
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4], [1e8, 1.0, -1e8, 1.0]])
    total = InvariantTopKRouter._sum(probs)
    assert torch.equal(total[:, 0], ((probs[:, 0] + probs[:, 1]) + probs[:, 2]) + probs[:, 3])


# ---- the linear-state recurrence -------------------------------------------------------------


def linear_inputs(length: int, heads: int = 2, dim: int = 16):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(length, heads, dim, generator=gen) for _ in range(3))
    q, k = nn.functional.normalize(q, dim=-1), nn.functional.normalize(k, dim=-1)
    log_gate = nn.functional.logsigmoid(torch.randn(length, heads, generator=gen) + 2)
    return q, k, v, log_gate, torch.zeros(heads, dim, dim)


def run_in_steps(scan, inputs, cuts):
    """Outputs and final state of `scan` over the tokens split at `cuts`, carrying the state."""
    q, k, v, log_gate, state = inputs
    outputs, bounds = [], [0, *cuts, q.shape[0]]
    for a, b in itertools.pairwise(bounds):
        out, state = scan(q[a:b], k[a:b], v[a:b], log_gate[a:b], state, 0.5)
        outputs.append(out)
    return torch.cat(outputs), state


def test_recurrence_matches_the_chunkwise_form():
    inputs = linear_inputs(150)
    want, want_state = gated_linear_attention(*inputs, 0.5)
    got, state = gated_linear_recurrence(*inputs, 0.5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cuts", [[1], [37], [64], [13, 77, 78, 140], list(range(1, 150))])
def test_recurrence_is_bitwise_the_same_however_the_tokens_are_split(cuts):
    inputs = linear_inputs(150)
    whole, whole_state = run_in_steps(gated_linear_recurrence, inputs, [])
    split, split_state = run_in_steps(gated_linear_recurrence, inputs, cuts)
    assert torch.equal(split, whole) and torch.equal(split_state, whole_state)


def test_the_chunkwise_form_is_not_split_invariant_the_reason_for_the_recurrence():
    inputs = linear_inputs(150)
    whole, _ = run_in_steps(gated_linear_attention, inputs, [])
    split, _ = run_in_steps(gated_linear_attention, inputs, [37])
    assert not torch.equal(split, whole)
