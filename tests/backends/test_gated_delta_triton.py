"""The gated delta rule's Triton launchers (`backends/triton/gated_delta_ops.py`) against
`gated_delta_math`, request by request: mixed lengths, nonzero offsets, read slot -1, read ==
write, write -1, GQA (Hv = 2 Hk), checkpoints on a chunk grid and after single rows, q and k
normalised by the caller or in the kernel.

On CPU the kernels run in Triton's interpreter (float16/float32: its bfloat16 is wrong); on a
GPU the same file runs with bfloat16 too.
"""

import pytest
import torch

from tests.backends.test_ssm_triton import checkpoint_rows, int32, qsl_of, rel_err
from unified_attn.backends import gated_delta_math
from unified_attn.backends.triton import gated_delta_ops as ops
from unified_attn.backends.triton.gated_delta_ops import (
    gated_delta_chunked_varlen,
    gated_delta_update,
)

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
DTYPES = [torch.float16, torch.bfloat16] if GPU else [torch.float16, torch.float32]
TOL = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
NUM_BLOCKS = 9


def rule_inputs(rows, key_heads, heads, k_dim, v_dim, dtype, seed):
    """Raw q and k (before the L2 norm), v, g (log decay) and beta, on DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(rows, key_heads, k_dim, generator=gen).to(DEVICE, dtype),
        "k": torch.randn(rows, key_heads, k_dim, generator=gen).to(DEVICE, dtype),
        "v": torch.randn(rows, heads, v_dim, generator=gen).to(DEVICE, dtype),
        "g": (-torch.rand(rows, heads, generator=gen) * 0.5).to(DEVICE),
        "beta": torch.rand(rows, heads, generator=gen).to(DEVICE),
    }


def kernel_qk(inp, l2norm):
    """(q, k, scale) as the launchers take them: raw with `l2norm`, else normalised here."""
    scale = inp["q"].shape[-1] ** -0.5
    if l2norm:
        return inp["q"], inp["k"], scale
    q, k = gated_delta_math.prepare_qk(inp["q"], inp["k"], inp["q"].shape[1])
    return (q / scale).to(inp["q"].dtype), k.to(inp["k"].dtype), scale


def read_states(states, reads):
    return [states[r] if r >= 0 else torch.zeros_like(states[0]) for r in reads]


def varlen_reference(inp, lengths, offsets, states, reads, writes, chunk, checkpoints):
    """(o, states after) by `gated_delta_math.gated_delta_chunked`, request by request."""
    heads = inp["v"].shape[1]
    q, k = gated_delta_math.prepare_qk(inp["q"], inp["k"], heads)
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    outs, after = [], states.clone()
    for r, before in enumerate(read_states(states, reads)):
        rows = slice(starts[r], starts[r + 1])
        saved = checkpoint_rows(offsets[r], lengths[r], chunk, checkpoints[r] if checkpoints
                                else [])  # fmt: skip
        state = before
        if lengths[r]:
            o, state, at = gated_delta_math.gated_delta_chunked(
                q[rows], k[rows], inp["v"][rows], inp["g"][rows], inp["beta"][rows], before,
                16, offsets[r], tuple(sorted(saved)),
            )  # fmt: skip
            outs.append(o)
            for row, s in zip(sorted(saved), at, strict=True):
                after[saved[row]] = s
        if writes[r] >= 0:
            after[writes[r]] = state
    return torch.cat(outs), after


VARLEN_CASES = {
    # lengths, offsets, read slots, write slots, chunk, checkpoint slots [R, M] or None
    "mixed": ([1, 5, 23, 11], [0, 3, 10, 16], [-1, 2, 5, 7], [3, 2, 6, -1], 8,
              [[-1, -1], [-1, -1], [0, 1], [4, 8]]),
    "every_row": ([4, 2], [7, 0], [1, -1], [1, 5], 1, [[2, -1, 3], [6, 8, -1]]),
    "one_token_each": ([1, 1, 1], [0, 15, 16], [4, 3, -1], [4, 5, 6], 64, None),
    "with_empty": ([9, 0, 13], [7, 5, 0], [1, 2, -1], [1, 3, 4], 64, None),
}  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("key_heads,heads", [(1, 2), (2, 2)])
@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize("case", VARLEN_CASES, ids=list(VARLEN_CASES))
def test_varlen_matches_gated_delta_math(dtype, key_heads, heads, l2norm, case):
    lengths, offsets, reads, writes, chunk, checkpoints = VARLEN_CASES[case]
    inp = rule_inputs(sum(lengths), key_heads, heads, 16, 32, dtype, seed=heads)
    states = torch.randn(NUM_BLOCKS, heads, 16, 32, device=DEVICE) * 0.3
    want_o, want_states = varlen_reference(inp, lengths, offsets, states, reads, writes, chunk,
                                           checkpoints)  # fmt: skip
    q, k, scale = kernel_qk(inp, l2norm)
    o = gated_delta_chunked_varlen(
        q, k, inp["v"], inp["g"], inp["beta"], qsl_of(lengths), int32(offsets), states,
        int32(reads), int32(writes), scale, chunk,
        int32(checkpoints) if checkpoints else None, l2norm=l2norm,
    )  # fmt: skip
    assert o.dtype == dtype
    assert rel_err(o, want_o) < TOL[dtype]
    assert rel_err(states, want_states) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("key_heads,heads,v_dim", [(2, 4, 32), (2, 2, 24)])
@pytest.mark.parametrize("l2norm", [True, False])
def test_update_matches_gated_delta_math(dtype, key_heads, heads, v_dim, l2norm):
    reads, writes = [-1, 2, 5, 7, 1], [3, 2, 6, -1, 8]
    inp = rule_inputs(len(reads), key_heads, heads, 16, v_dim, dtype, seed=v_dim)
    states = torch.randn(NUM_BLOCKS, heads, 16, v_dim, device=DEVICE) * 0.3
    q, k = gated_delta_math.prepare_qk(inp["q"], inp["k"], heads)
    want_o, new = gated_delta_math.gated_delta_step(
        q, k, inp["v"], inp["g"], inp["beta"], torch.stack(read_states(states, reads))
    )
    want_states = states.clone()
    for r, write in enumerate(writes):
        if write >= 0:
            want_states[write] = new[r]
    q, k, scale = kernel_qk(inp, l2norm)
    o = gated_delta_update(q, k, inp["v"], inp["g"], inp["beta"], states, int32(reads),
                           int32(writes), scale, l2norm=l2norm)  # fmt: skip
    assert o.dtype == dtype
    assert rel_err(o, want_o) < TOL[dtype]
    assert rel_err(states, want_states) < TOL[dtype]


def test_update_with_the_large_tiles_of_big_batches():
    """From 64 requests the decode kernel takes `[Dk, 2 x BLOCK_V]` tiles (Dk 64, Dv 128: one
    128-column tile instead of two of 64); a permutation of slots, read == write."""
    rows, heads, k_dim, v_dim = ops.LARGE_TILE_FROM, 2, 64, 128
    assert ops.update_tiles(k_dim, v_dim, rows)[0] == 2 * ops.update_tiles(k_dim, v_dim, 1)[0]
    inp = rule_inputs(rows, 1, heads, k_dim, v_dim, torch.float32, seed=7)
    states = torch.randn(rows + 1, heads, k_dim, v_dim, device=DEVICE) * 0.3
    slots = torch.randperm(rows + 1)[:rows].tolist()
    q, k = gated_delta_math.prepare_qk(inp["q"], inp["k"], heads)
    want_o, new = gated_delta_math.gated_delta_step(q, k, inp["v"], inp["g"], inp["beta"],
                                                    states[slots])  # fmt: skip
    want_states = states.clone()
    want_states[slots] = new
    o = gated_delta_update(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], states,
                           int32(slots), int32(slots), k_dim**-0.5, l2norm=True)  # fmt: skip
    assert rel_err(o, want_o) < TOL[torch.float32]
    assert rel_err(states, want_states) < TOL[torch.float32]


def test_launchers_name_bad_inputs():
    inp = rule_inputs(2, 3, 4, 16, 16, torch.float32, seed=0)
    states = torch.zeros(NUM_BLOCKS, 4, 16, 16, device=DEVICE)
    with pytest.raises(ValueError, match="3 heads, expected a divisor of v's 4"):
        gated_delta_update(**inp, states=states, read_slots=int32([0, 1]),
                           write_slots=int32([0, 1]), scale=1.0)  # fmt: skip
    inp = rule_inputs(2, 2, 4, 16, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="states has shape"):
        gated_delta_update(**inp, states=states[:, :2], read_slots=int32([0, 1]),
                           write_slots=int32([0, 1]), scale=1.0)  # fmt: skip
