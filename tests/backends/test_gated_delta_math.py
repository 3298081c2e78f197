"""The gated delta rule's torch ops against transformers' own
(`models/qwen3_next/modeling_qwen3_next.py`): the chunked rule with an initial state, the
one-token recurrence, checkpoints inside a step."""

import pytest
import torch

from unified_attn.backends.gated_delta_math import (
    gated_delta_chunked,
    gated_delta_step,
    prepare_qk,
)

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

HK, HV, DK, DV = 2, 4, 8, 16


def inputs(num_tokens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, HK, DK, generator=gen)
    k = torch.randn(num_tokens, HK, DK, generator=gen)
    v = torch.randn(num_tokens, HV, DV, generator=gen)
    g = -torch.rand(num_tokens, HV, generator=gen) * 0.5  # log decay, <= 0
    beta = torch.rand(num_tokens, HV, generator=gen)
    state = torch.randn(HV, DK, DV, generator=gen)
    return q, k, v, g, beta, state


def transformers_chunked(q, k, v, g, beta, state, chunk):
    out, final = qwen3_next.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], chunk_size=chunk,
        initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return out[0], final[0]


@pytest.mark.parametrize("num_tokens,chunk", [(1, 4), (13, 4), (16, 16), (40, 8)])
def test_chunked_matches_transformers(num_tokens, chunk):
    q, k, v, g, beta, state = inputs(num_tokens)
    expected, expected_state = transformers_chunked(q, k, v, g, beta, state, chunk)
    qn, kn = prepare_qk(q, k, HV)
    for offset in (0, 3):  # chunk ends at other rows: the same result
        o, final, _ = gated_delta_chunked(qn, kn, v, g, beta, state, 5, offset=offset)
        torch.testing.assert_close(o, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final, expected_state, atol=1e-5, rtol=1e-5)


def test_checkpoints_are_the_states_after_those_tokens():
    q, k, v, g, beta, state = inputs(24, seed=1)
    qn, kn = prepare_qk(q, k, HV)
    # rows 6 and 13 are not chunk ends (chunks of 8 after 3 earlier tokens): split there too
    _, _, saved = gated_delta_chunked(qn, kn, v, g, beta, state, 8, offset=3,
                                      checkpoints=(5, 6, 13, 24))  # fmt: skip
    for end, got in zip((5, 6, 13, 24), saved, strict=True):
        _, expected = transformers_chunked(q[:end], k[:end], v[:end], g[:end], beta[:end],
                                           state, 4)  # fmt: skip
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_step_matches_transformers_recurrence():
    q, k, v, g, beta, _ = inputs(3, seed=2)
    states = torch.randn(3, HV, DK, DV)
    expected, expected_states = qwen3_next.torch_recurrent_gated_delta_rule(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], initial_state=states,
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    qn, kn = prepare_qk(q, k, HV)
    o, new_states = gated_delta_step(qn, kn, v, g, beta, states)
    torch.testing.assert_close(o, expected[:, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_states, expected_states, atol=1e-5, rtol=1e-5)


def test_steps_continue_a_chunked_prefill():
    q, k, v, g, beta, state = inputs(12, seed=3)
    expected, expected_state = transformers_chunked(q, k, v, g, beta, state, 4)
    qn, kn = prepare_qk(q, k, HV)
    o, current, _ = gated_delta_chunked(qn[:9], kn[:9], v[:9], g[:9], beta[:9], state, 4)
    outputs = [o]
    for t in range(9, 12):
        o, current = gated_delta_step(qn[t : t + 1], kn[t : t + 1], v[t : t + 1],
                                      g[t : t + 1], beta[t : t + 1], current[None])  # fmt: skip
        outputs.append(o)
        current = current[0]
    torch.testing.assert_close(torch.cat(outputs), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(current, expected_state, atol=1e-5, rtol=1e-5)
