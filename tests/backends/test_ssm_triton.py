"""The Mamba-2 Triton launchers (`backends/triton/ssm_ops.py`) against `mamba_math`, request by
request, over grids of mixed batches: 1-token requests, ones shorter than the conv window,
nonzero offsets, read slot -1, read == write slot, write slot -1, G < H, checkpoints.

On CPU the kernels run in Triton's interpreter (float16/float32: its bfloat16 is wrong); on a
GPU the same file runs with bfloat16 too.
"""

import math

import pytest
import torch

from unified_attn.backends import mamba_math
from unified_attn.backends.triton.ssm_ops import (
    causal_conv1d_update,
    causal_conv1d_varlen,
    ssd_scan_varlen,
    ssd_state_update,
)

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
DTYPES = [torch.float16, torch.bfloat16] if GPU else [torch.float16, torch.float32]
TOL = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
NUM_BLOCKS = 9


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def qsl_of(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                        device=DEVICE)  # fmt: skip


def int32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


# ---- causal convolution ----------------------------------------------------------------------


def conv_reference(x, lengths, states, reads, writes, weight, bias):
    """(y, states after) by `mamba_math.causal_conv1d`, request by request."""
    ys, after = [], states.clone()
    for rows, read, write in zip(x.split(lengths), reads, writes, strict=True):
        carried = states[read] if read >= 0 else torch.zeros_like(states[0])
        y, last = mamba_math.causal_conv1d(rows, carried, weight, bias)
        ys.append(y)
        if write >= 0:
            after[write] = last
    return torch.cat(ys), after


CONV_CASES = {
    # lengths, read slots, write slots
    "mixed": ([1, 2, 7, 40], [-1, 3, 5, 0], [4, 3, 6, -1]),
    "short_in_place": ([2, 1, 1], [1, 2, -1], [1, 2, 8]),
    "one_long": ([70], [2], [2]),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [4, 2])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("case", CONV_CASES, ids=list(CONV_CASES))
def test_causal_conv1d_varlen_matches_mamba_math(dtype, width, has_bias, case):
    lengths, reads, writes = CONV_CASES[case]
    torch.manual_seed(len(lengths) + width)
    channels = 40
    x = torch.randn(sum(lengths), channels, device=DEVICE).to(dtype)
    states = torch.randn(NUM_BLOCKS, width - 1, channels, device=DEVICE).to(dtype)
    weight = (torch.randn(channels, width, device=DEVICE) / width).to(dtype)
    bias = torch.randn(channels, device=DEVICE).to(dtype) if has_bias else None
    want_y, want_states = conv_reference(x, lengths, states, reads, writes, weight, bias)
    y = causal_conv1d_varlen(x, qsl_of(lengths), states, int32(reads), int32(writes), weight,
                             bias)  # fmt: skip
    assert y.dtype == dtype
    assert rel_err(y, want_y) < TOL[dtype]
    assert rel_err(states, want_states) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [4, 3])
def test_causal_conv1d_update_matches_mamba_math(dtype, width):
    torch.manual_seed(width)
    channels, reads, writes = 200, [-1, 3, 5, 0], [4, 3, 6, -1]
    x = torch.randn(len(reads), channels, device=DEVICE).to(dtype)
    states = torch.randn(NUM_BLOCKS, width - 1, channels, device=DEVICE).to(dtype)
    weight = torch.randn(channels, width, device=DEVICE).to(dtype)
    bias = torch.randn(channels, device=DEVICE).to(dtype)
    want_y, want_states = conv_reference(x, [1] * len(reads), states, reads, writes, weight,
                                         bias)  # fmt: skip
    y = causal_conv1d_update(x, states, int32(reads), int32(writes), weight, bias)
    assert rel_err(y, want_y) < TOL[dtype]
    assert rel_err(states, want_states) < TOL[dtype]


# ---- SSD scan --------------------------------------------------------------------------------


def ssd_inputs(num_tokens, heads, head_dim, groups, state_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE)

    return {
        "x": randn(num_tokens, heads, head_dim).to(dtype),
        "dt": randn(num_tokens, heads, scale=0.5).to(dtype),
        "dt_bias": randn(heads, scale=0.5) - 1.0,
        "A": -torch.rand(heads, generator=gen).to(DEVICE) * 2 - 0.1,
        "B": randn(num_tokens, groups, state_dim, scale=0.5).to(dtype),
        "C": randn(num_tokens, groups, state_dim, scale=0.5).to(dtype),
        "D": randn(heads),
    }


def checkpoint_rows(offset, length, chunk, slots):
    """{row count: slot} of the contract: entry j <-> position (offset // chunk + 1 + j) * chunk."""
    rows = {}
    for j, slot in enumerate(slots):
        row = (offset // chunk + 1 + j) * chunk - offset
        if slot >= 0 and row <= length:
            rows[row] = slot
    return rows


def scan_reference(inp, lengths, offsets, states, reads, writes, chunk, limit, checkpoints):
    """(y, states after) by `mamba_math.ssd_scan`, request by request."""
    ys, after = [], states.clone()
    dt_all = mamba_math.discretize(inp["dt"], inp["dt_bias"], limit)
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    for r, (read, write) in enumerate(zip(reads, writes, strict=True)):
        rows = slice(starts[r], starts[r + 1])
        state = states[read] if read >= 0 else torch.zeros_like(states[0])
        saved = checkpoint_rows(offsets[r], lengths[r], chunk, checkpoints[r] if checkpoints
                                else [])  # fmt: skip
        if lengths[r]:
            y, state, states_at = mamba_math.ssd_scan(
                inp["x"][rows], dt_all[rows], inp["A"], inp["B"][rows], inp["C"][rows], state,
                chunk, offset=offsets[r], checkpoints=tuple(sorted(saved)),
            )  # fmt: skip
            ys.append(y + inp["D"][:, None] * inp["x"][rows].float())
            for row, s in zip(sorted(saved), states_at, strict=True):
                after[saved[row]] = s
        if write >= 0:
            after[write] = state
    return torch.cat(ys).to(inp["x"].dtype), after


SCAN_CASES = {
    # lengths, offsets, read slots, write slots, checkpoint slots [R, M] or None
    "mixed": ([1, 5, 40, 17], [0, 3, 30, 16], [-1, 2, 5, 7], [3, 2, 6, -1],
              [[-1, -1], [-1, -1], [0, 1], [4, 8]]),
    "aligned_end": ([32, 3, 16], [0, 29, 48], [-1, 4, 1], [5, 8, 1],
                    [[2, 3, 4], [6, -1, -1], [0, -1, 7]]),
    "one_token_each": ([1, 1, 1], [0, 15, 16], [4, 3, -1], [4, 5, 6], None),
    "with_empty": ([9, 0, 20], [7, 5, 0], [1, 2, -1], [1, 3, 4], None),
}  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,groups", [(4, 2), (2, 1)])
@pytest.mark.parametrize("case", SCAN_CASES, ids=list(SCAN_CASES))
def test_ssd_scan_varlen_matches_mamba_math(dtype, heads, groups, case):
    lengths, offsets, reads, writes, checkpoints = SCAN_CASES[case]
    head_dim, state_dim, chunk = 16, 16, 16
    limit = (0.0, math.inf) if case != "mixed" else (0.01, 0.5)
    inp = ssd_inputs(sum(lengths), heads, head_dim, groups, state_dim, dtype, seed=heads)
    states = torch.randn(NUM_BLOCKS, heads, head_dim, state_dim, device=DEVICE)
    want_y, want_states = scan_reference(inp, lengths, offsets, states, reads, writes, chunk,
                                         limit, checkpoints)  # fmt: skip
    y = ssd_scan_varlen(
        **inp, query_start_loc=qsl_of(lengths), offsets=int32(offsets), ssm_states=states,
        read_slots=int32(reads), write_slots=int32(writes), chunk_size=chunk, dt_limit=limit,
        checkpoint_slots=int32(checkpoints) if checkpoints else None,
    )  # fmt: skip
    assert y.dtype == dtype
    assert rel_err(y, want_y) < TOL[dtype]
    assert rel_err(states, want_states) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,groups", [(4, 2), (4, 4)])
def test_ssd_state_update_matches_mamba_math(dtype, heads, groups):
    reads, writes = [-1, 2, 5, 7, 1], [3, 2, 6, -1, 8]
    head_dim, state_dim = 16, 32
    inp = ssd_inputs(len(reads), heads, head_dim, groups, state_dim, dtype, seed=groups)
    states = torch.randn(NUM_BLOCKS, heads, head_dim, state_dim, device=DEVICE)
    limit = (0.0, 0.3)
    before = torch.stack([states[r] if r >= 0 else torch.zeros_like(states[0]) for r in reads])
    dt = mamba_math.discretize(inp["dt"], inp["dt_bias"], limit)
    want_y, new = mamba_math.ssd_step(inp["x"], dt, inp["A"], inp["B"], inp["C"], before)
    want_y = want_y + inp["D"][:, None] * inp["x"].float()
    want_states = states.clone()
    for r, write in enumerate(writes):
        if write >= 0:
            want_states[write] = new[r]
    y = ssd_state_update(**inp, ssm_states=states, read_slots=int32(reads),
                         write_slots=int32(writes), dt_limit=limit)  # fmt: skip
    assert rel_err(y, want_y) < TOL[dtype]
    assert rel_err(states, want_states) < TOL[dtype]


def test_one_step_scan_equals_the_decode_update():
    """A decode step through the varlen scan (rows of 1) and through the update agree."""
    reads = [0, 1, -1]
    inp = ssd_inputs(3, 4, 16, 2, 16, torch.float32, seed=3)
    states = torch.randn(NUM_BLOCKS, 4, 16, 16, device=DEVICE)
    states2 = states.clone()
    y1 = ssd_state_update(**inp, ssm_states=states, read_slots=int32(reads),
                          write_slots=int32([3, 4, 5]))  # fmt: skip
    y2 = ssd_scan_varlen(**inp, query_start_loc=qsl_of([1, 1, 1]), offsets=int32([5, 16, 0]),
                         ssm_states=states2, read_slots=int32(reads),
                         write_slots=int32([3, 4, 5]), chunk_size=16)  # fmt: skip
    assert rel_err(y1, y2) < 1e-5
    assert rel_err(states, states2) < 1e-5


# ---- input checks ----------------------------------------------------------------------------


def test_errors_name_the_input_and_what_was_expected():
    inp = ssd_inputs(3, 4, 16, 2, 16, torch.float32, seed=0)
    states = torch.zeros(NUM_BLOCKS, 4, 16, 16, device=DEVICE)
    slots = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="read_slots has dtype int64, expected int32"):
        ssd_state_update(**inp, ssm_states=states, read_slots=slots, write_slots=slots)
    with pytest.raises(ValueError, match=r"ssm_states has shape \[9, 4, 16, 8\], expected"):
        ssd_state_update(**inp, ssm_states=states[..., :8], read_slots=int32([0, 1, 2]),
                         write_slots=int32([0, 1, 2]))  # fmt: skip
    with pytest.raises(ValueError, match="chunk_size is 24"):
        ssd_scan_varlen(**inp, query_start_loc=qsl_of([3]), offsets=int32([0]),
                        ssm_states=states, read_slots=int32([0]), write_slots=int32([0]),
                        chunk_size=24)  # fmt: skip
    with pytest.raises(ValueError, match="3 groups, expected a divisor of the 4 heads"):
        bad = {**inp, "B": inp["B"].new_zeros(3, 3, 16), "C": inp["C"].new_zeros(3, 3, 16)}
        ssd_state_update(**bad, ssm_states=states, read_slots=int32([0, 1, 2]),
                         write_slots=int32([0, 1, 2]))  # fmt: skip


def test_pdl_is_off_on_cpu_and_when_the_environment_says_so(monkeypatch):
    from unified_attn.kernels.pdl import pdl_enabled

    assert not pdl_enabled(torch.device("cpu"))
    monkeypatch.setenv("UNIFIED_ATTN_PDL", "0")
    assert not pdl_enabled(torch.device("cuda", 0))  # decided before asking the device
    monkeypatch.setenv("UNIFIED_ATTN_PDL", "off")
    with pytest.raises(ValueError, match="UNIFIED_ATTN_PDL='off': expected 0 or 1"):
        pdl_enabled(torch.device("cpu"))
