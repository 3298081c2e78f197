"""The Mamba-2 torch ops against transformers' own (`models/mamba2/modeling_mamba2.py`): the
chunked SSD scan with an initial state, the one-token update, the causal convolution."""

import pytest
import torch

from unified_attn.backends.mamba_math import causal_conv1d, discretize, ssd_scan, ssd_step

mamba2 = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")

H, P, G, N = 4, 8, 2, 16


def inputs(num_tokens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, H, P, generator=gen)
    dt = torch.randn(num_tokens, H, generator=gen)
    A = -torch.rand(H, generator=gen) * 2 - 0.1
    B = torch.randn(num_tokens, G, N, generator=gen)
    C = torch.randn(num_tokens, G, N, generator=gen)
    dt_bias = torch.randn(H, generator=gen) * 0.1
    state = torch.randn(H, P, N, generator=gen)
    return x, dt, A, B, C, dt_bias, state


@pytest.mark.parametrize("num_tokens,chunk", [(1, 4), (13, 4), (16, 16), (40, 8)])
def test_scan_matches_transformers_chunk_scan(num_tokens, chunk):
    x, dt, A, B, C, dt_bias, state = inputs(num_tokens)
    expected, expected_state = mamba2.mamba2_chunk_scan(
        x[None], dt[None], A, B[None], C[None], chunk_size=chunk, D=None, dt_bias=dt_bias,
        initial_states=state[None], dt_softplus=True, return_final_states=True,
    )  # fmt: skip
    dtd = discretize(dt, dt_bias, (0.0, float("inf")))
    for offset in (0, 3):  # chunk ends at other rows: the same result
        y, final, _ = ssd_scan(x, dtd, A, B, C, state, 5, offset=offset)
        torch.testing.assert_close(y, expected[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final, expected_state[0], atol=1e-5, rtol=1e-5)


def test_scan_checkpoints_are_the_states_after_those_tokens():
    x, dt, A, B, C, dt_bias, state = inputs(24, seed=1)
    dtd = discretize(dt, dt_bias, (0.0, float("inf")))
    # 3 tokens came before: chunks end at rows 5, 13, 21 (absolute 8, 16, 24) and 24
    _, _, saved = ssd_scan(x, dtd, A, B, C, state, 8, offset=3, checkpoints=(5, 13, 24))
    for end, got in zip((5, 13, 24), saved, strict=True):
        _, expected, _ = ssd_scan(x[:end], dtd[:end], A, B, C, state, 3)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # a checkpoint between chunk ends splits the chunk: the state after 12 rows
    _, _, (after_12,) = ssd_scan(x, dtd, A, B, C, state, 8, checkpoints=(12,))
    _, expected, _ = ssd_scan(x[:12], dtd[:12], A, B, C, state, 5)
    torch.testing.assert_close(after_12, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="row counts"):
        ssd_scan(x, dtd, A, B, C, state, 8, checkpoints=(0,))


def test_step_matches_transformers_state_update():
    x, dt, A, B, C, dt_bias, _ = inputs(3, seed=2)
    states = torch.randn(3, H, P, N)
    expected_states = states.clone()
    expected = mamba2.mamba2_selective_state_update(
        expected_states, x, dt[:, :, None].expand(-1, -1, P), A[:, None, None].expand(-1, P, N),
        B, C, None, dt_bias=dt_bias[:, None].expand(-1, P), dt_softplus=True,
    )  # fmt: skip
    y, new_states = ssd_step(x, discretize(dt, dt_bias, (0.0, float("inf"))), A, B, C, states)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_states, expected_states, atol=1e-5, rtol=1e-5)


def test_conv_carries_the_last_inputs_across_calls():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(11, 6, generator=gen)
    weight, bias = torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen)
    expected = mamba2.causal_conv1d_fn(x.t()[None], weight, bias, activation="silu")[0].t()
    first, carried = causal_conv1d(x[:5], torch.zeros(3, 6), weight, bias)
    second, carried = causal_conv1d(x[5:], carried, weight, bias)
    torch.testing.assert_close(torch.cat([first, second]), expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(carried, x[-3:])
