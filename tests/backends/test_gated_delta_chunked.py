"""The chunked (WY) form of the gated delta rule's prefill (`gated_delta_chunked_varlen` with
kernel="chunked", `kernels/ssm/gated_delta_{wy,chunked}.py`) against `gated_delta_math` and
against the token-by-token kernel: requests of 0, 1, 63, 64, 65 and 150 rows, nonzero offsets
(a first chunk cut short), read slot -1 and >= 0, write slot -1, GQA, q and k normalised by
the caller or in the kernel, head sizes that are not powers of two, checkpoints every 64 and
128 positions (one at a request's last row), and which kernel "auto" picks (token by token).

On CPU the kernels run in Triton's interpreter (float16/float32: its bfloat16 is wrong); on a
GPU the file adds bfloat16, Qwen3-Next-80B's head sizes and the benchmark's state tiles.
"""


import pytest
import torch

from tests.backends.test_gated_delta_triton import kernel_qk, rule_inputs, varlen_reference
from tests.backends.test_ssm_triton import int32, qsl_of, rel_err
from unified_attn.backends.triton import gated_delta_ops as ops
from unified_attn.backends.triton.gated_delta_ops import gated_delta_chunked_varlen

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16] if GPU else [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
NUM_BLOCKS = 12

CASES = {
    # lengths, offsets, read slots, write slots, chunk_size, checkpoint slots [R, M] or None
    "mixed": ([1, 63, 0, 64, 65, 150], [0, 5, 9, 64, 100, 30], [-1, 2, 3, 5, 7, 1],
              [4, 2, 9, 6, -1, 8], 64, None),
    "checkpoints_64": ([150, 65, 1], [30, 0, 63], [1, -1, 2], [1, 4, 5], 64,
                       [[6, 7, 10], [8, -1, -1], [0, -1, -1]]),
    "checkpoints_128": ([200, 64, 9], [100, 64, 127], [-1, 9, 2], [3, 4, 2], 128,
                        [[5, 6], [7, -1], [8, -1]]),
}  # fmt: skip
# (key heads, value heads, Dk, Dv, l2norm): GQA with the norms in the kernel; Hk = Hv, odd sizes
HEADS = [(1, 2, 16, 32, True), (2, 2, 24, 20, False)]


def run(inp, case, l2norm, kernel, states, tiles=None):
    """(o, states after) of `gated_delta_chunked_varlen` on a copy of `states`."""
    lengths, offsets, reads, writes, chunk, checkpoints = case
    q, k, scale = kernel_qk(inp, l2norm)
    after = states.clone()
    args = (q, k, inp["v"], inp["g"], inp["beta"], qsl_of(lengths), int32(offsets), after,
            int32(reads), int32(writes), scale, chunk)  # fmt: skip
    ckpt = int32(checkpoints) if checkpoints else None
    if tiles is None:
        return gated_delta_chunked_varlen(*args, ckpt, l2norm=l2norm, kernel=kernel), after
    o = torch.empty_like(inp["v"])
    ops.launch_chunked(*args[:10], ckpt, o, scale, chunk, l2norm, tiles)
    return o, after


def reference(inp, case, states):
    lengths, offsets, reads, writes, chunk, checkpoints = case
    return varlen_reference(inp, lengths, offsets, states, reads, writes, chunk, checkpoints)


def inputs(case, key_heads, heads, k_dim, v_dim, dtype, seed=0):
    inp = rule_inputs(sum(case[0]), key_heads, heads, k_dim, v_dim, dtype, seed)
    return inp, torch.randn(NUM_BLOCKS, heads, k_dim, v_dim, device=DEVICE) * 0.3


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("key_heads,heads,k_dim,v_dim,l2norm", HEADS)
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_chunked_matches_gated_delta_math(dtype, key_heads, heads, k_dim, v_dim, l2norm, case):
    inp, states = inputs(CASES[case], key_heads, heads, k_dim, v_dim, dtype)
    want_o, want_states = reference(inp, CASES[case], states)
    o, after = run(inp, CASES[case], l2norm, "chunked", states)
    assert o.dtype == dtype
    assert rel_err(o, want_o) < TOL[dtype]
    assert rel_err(after, want_states) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunked_matches_the_token_by_token_kernel(dtype):
    case = CASES["checkpoints_64"]
    inp, states = inputs(case, 1, 1, 16, 16, dtype, seed=5)
    o, after = run(inp, case, True, "chunked", states)
    want_o, want_states = run(inp, case, True, "tokens", states)
    assert rel_err(o, want_o) < TOL[dtype]
    assert rel_err(after, want_states) < TOL[dtype]


def test_auto_picks_the_chunked_form_where_it_applies(monkeypatch):
    """"auto": the chunked form for 64 rows or more of one dtype whose checkpoints (if any) fall
    on multiples of 64; the token-by-token kernel otherwise."""
    calls = []
    monkeypatch.setattr(ops, "launch_chunked", lambda *args: calls.append("chunked"))
    monkeypatch.setattr(ops, "_launch_varlen", lambda *args: calls.append("tokens"))
    for rows in (12, 64):
        inp = rule_inputs(rows, 1, 2, 16, 16, torch.float32, seed=0)
        states = torch.zeros(4, 2, 16, 16, device=DEVICE)
        args = (*inp.values(), qsl_of([rows]), int32([0]), states, int32([0]), int32([1]), 1.0)
        for chunk_size, ckpt in ((1, None), (128, int32([[2, 3]])), (8, int32([[2, 3]]))):
            gated_delta_chunked_varlen(*args, chunk_size, ckpt)
        gated_delta_chunked_varlen(*args, 64, kernel="tokens")
        gated_delta_chunked_varlen(*args, 64, kernel="chunked")
    assert calls == ["tokens", "tokens", "tokens", "tokens", "chunked",
                     "chunked", "chunked", "tokens", "tokens", "chunked"]  # fmt: skip
    q, k, v, g, beta = rule_inputs(64, 1, 2, 16, 16, torch.float32, seed=0).values()
    calls.clear()
    gated_delta_chunked_varlen(q.half(), k.half(), v, g, beta, qsl_of([64]), int32([0]),
                               states, int32([0]), int32([1]), 1.0, 64)  # fmt: skip
    assert calls == ["tokens"]  # mixed dtypes


def test_chunked_names_what_it_cannot_take():
    inp = rule_inputs(3, 1, 2, 16, 16, torch.float32, seed=0)
    states = torch.zeros(4, 2, 16, 16, device=DEVICE)
    q, k, v, g, beta = inp.values()
    args = (g, beta, qsl_of([3]), int32([0]), states, int32([0]), int32([1]), 1.0)
    with pytest.raises(ValueError, match="chunk_size a multiple of 64, found 32"):
        gated_delta_chunked_varlen(q, k, v, *args, 32, int32([[2]]), kernel="chunked")
    with pytest.raises(ValueError, match=r"one dtype, found \['float16', 'float16', 'float32'\]"):
        gated_delta_chunked_varlen(q.half(), k.half(), v, *args, 64, kernel="chunked")
    with pytest.raises(ValueError, match="kernel is 'wy', expected one of"):
        gated_delta_chunked_varlen(q, k, v, *args, 64, kernel="wy")


# Hk=2, Hv=4 (Qwen3-Next-80B's ratio), Dk = Dv = 128, checkpoints every 128 positions
REAL = ([1, 300, 1000, 2049, 37], [0, 100, 256, 64, 5], [-1, 2, 3, -1, 5], [1, 2, 6, 7, -1], 128,
        [[-1] * 4, [8, -1, -1, -1], [9, 10, 11, 12], [13, 14, 15, -1], [-1] * 4])  # fmt: skip
# (32, 4, 1) is left out: Triton 3.6 reads shared memory out of bounds there on an H200
# (compute-sanitizer: the P (v_new) product), a compiler fault no launcher configuration uses
TILES = [(16, 4, 2), (32, 4, 2), (32, 4, 3), (32, 8, 2), (64, 4, 2), (64, 4, 3), (64, 8, 3)]


@pytest.mark.skipif(not GPU, reason="Qwen3-Next-80B's head sizes: GPU only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("tiles", [None, *TILES], ids=str)
def test_chunked_at_real_head_sizes(dtype, tiles):
    """Every state tile (BLOCK_V, warps, stages) the benchmark sweeps."""
    inp = rule_inputs(sum(REAL[0]), 2, 4, 128, 128, dtype, seed=1)
    states = torch.randn(16, 4, 128, 128, device=DEVICE) * 0.1
    want_o, want_states = reference(inp, REAL, states)
    o, after = run(inp, REAL, True, "chunked", states, tiles)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert rel_err(o, want_o) < tol
    assert rel_err(after, want_states) < tol
