"""GPU-only checks of the Hopper MLA decode kernels (mla_sm90.py: the warp-specialized kernel
for pages of a multiple of 64 keys, the lockstep kernel otherwise; run through the device tool
on an sm90 GPU): bf16 and float16 against a float32 torch oracle and against each other and
the portable kernel, with and without split-KV, at several page sizes and latent widths, padded
head groups, empty and one-key requests, pages whose unwritten rows hold NaN, blocks further
apart than a page, and CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.graphs import assert_replay_equals_eager, capture
from unified_attn.backends.triton.mla_ops import MLAScratch, mla_attention
from unified_attn.backends.triton.mla_plan import HOPPER_TILES, MLATiles, plan_mla
from unified_attn.backends.triton.mla_sm90 import hopper_reasons

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not SM90, reason="needs an sm90 GPU")

SCALE = 192**-0.5
# bf16 inputs and output against a float32 oracle on the same bf16 values: the output's own
# rounding plus bf16 probabilities in the value product (as tests/gpu/test_mla_triton_gpu.py).
ATOL, RTOL = 1e-2, 2e-2


def make_inputs(seq_lens, heads, gen, *, page=64, L=512, R=64, dtype=torch.bfloat16):
    """One decode token per request over `seq_lens[i]` cached keys in randomly permuted pages;
    unwritten rows hold NaN (a kernel that reads past a request's keys fails)."""
    pages = [-(-s // page) for s in seq_lens]
    num_blocks = sum(pages) + 1
    cache = torch.full((num_blocks, page, L + R), float("nan"), dtype=dtype, device="cuda")
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(seq_lens), max(pages) + 1, dtype=torch.int32)
    for i, (n, s) in enumerate(zip(pages, seq_lens, strict=True)):
        table[i, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
        pos = torch.arange(s)
        cache[table[i, pos // page].long(), pos % page] = (
            torch.randn(s, L + R, generator=gen).to(dtype).cuda()
        )
    q = torch.randn(len(seq_lens), heads, L + R, generator=gen).to(dtype).cuda()
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return q, cache, table.cuda(), qsl, lens


def oracle(q, cache, table, seq_lens, L):
    page = cache.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], L, device="cuda")
    for i, seq_len in enumerate(seq_lens.tolist()):
        pos = torch.arange(seq_len, device="cuda")
        keys = cache[table[i, pos // page].long(), pos % page].float()
        scores = torch.einsum("hd,kd->hk", q[i].float(), keys) * SCALE
        out[i] = torch.softmax(scores, -1).nan_to_num(0.0) @ keys[:, :L]
    return out


def attend(q, cache, table, qsl, seq_lens, L, *, tiles=None, num_segments=None, max_seq_len=None):
    plan = plan_mla(
        num_reqs=q.shape[0], num_tokens=q.shape[0], num_heads=q.shape[1], max_query_len=1,
        max_seq_len=max_seq_len or max(int(seq_lens.max()), 1), dtype=q.dtype, device=q.device,
        tiles=tiles, num_segments=num_segments, latent_dims=(L, q.shape[2] - L),
    )  # fmt: skip
    scratch = MLAScratch()
    if plan.split is not None:
        scratch.ensure(q.shape[0], q.shape[1], plan.split.num_segments, L, q.device)
    out = torch.full((q.shape[0], q.shape[1], L), float("nan"), dtype=q.dtype, device="cuda")
    mla_attention(q, cache, table, qsl, seq_lens, SCALE, out, L, plan=plan, scratch=scratch)
    return out, plan


@pytest.mark.parametrize("heads", [128, 64, 96, 32, 40])  # 32 and 40: one padded program
@pytest.mark.parametrize("num_segments", [None, 1, 3], ids=["auto", "one", "three"])
def test_bf16_decode_matches_the_oracle(heads, num_segments):
    gen = torch.Generator().manual_seed(heads)
    inputs = make_inputs([8191, 3000, 17, 4100, 64, 65, 1, 0], heads, gen)
    got, plan = attend(*inputs, 512, num_segments=num_segments)
    assert plan.tiles == HOPPER_TILES
    if num_segments is None:
        assert plan.split is not None  # 8 requests leave most SMs idle
    want = oracle(inputs[0], inputs[1], inputs[2], inputs[4], 512)
    torch.testing.assert_close(got.float(), want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("page", [16, 32, 128, 1])
def test_any_page_size(page):
    gen = torch.Generator().manual_seed(page)
    inputs = make_inputs([1000, 129, 31], 128, gen, page=page)
    got, _ = attend(*inputs, 512, num_segments=2)
    want = oracle(inputs[0], inputs[1], inputs[2], inputs[4], 512)
    torch.testing.assert_close(got.float(), want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(("L", "R"), [(256, 32), (128, 16), (512, 128)])
def test_other_latent_widths(L, R):
    gen = torch.Generator().manual_seed(L + R)
    inputs = make_inputs([700, 65, 5], 64, gen, L=L, R=R)
    tiles = MLATiles(64, 1, 32, 8, 2, hopper=True) if R == 128 else None  # lockstep: 227 KiB
    got, plan = attend(*inputs, L, tiles=tiles, num_segments=1)
    assert plan.tiles.hopper
    want = oracle(inputs[0], inputs[1], inputs[2], inputs[4], L)
    torch.testing.assert_close(got.float(), want, atol=ATOL, rtol=RTOL)


def test_float16_and_the_32_key_tile():
    gen = torch.Generator().manual_seed(7)
    inputs = make_inputs([2049, 300, 0], 128, gen, dtype=torch.float16)
    want = oracle(inputs[0], inputs[1], inputs[2], inputs[4], 512)
    for tiles in (None, LOCKSTEP, MLATiles(64, 1, 32, 8, 3, hopper=True)):
        got, plan = attend(*inputs, 512, tiles=tiles)
        assert plan.tiles.hopper
        torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3)


LOCKSTEP = MLATiles(64, 1, 64, 8, 2, hopper=True)


@pytest.mark.parametrize("num_segments", [1, 3])
def test_the_three_kernels_agree(num_segments):
    gen = torch.Generator().manual_seed(8)
    inputs = make_inputs([4096, 1500, 800, 3, 130], 128, gen)
    specialized, _ = attend(*inputs, 512, num_segments=num_segments)
    lockstep, _ = attend(*inputs, 512, tiles=LOCKSTEP, num_segments=num_segments)
    portable, plan = attend(*inputs, 512, tiles=MLATiles(64, 1, 64, 8, 2),
                            num_segments=num_segments)  # fmt: skip
    assert not plan.tiles.hopper
    for other in (lockstep, portable):
        torch.testing.assert_close(specialized.float(), other.float(), atol=ATOL, rtol=RTOL)


def test_blocks_further_apart_than_a_page():
    """A cache view whose blocks are two pages apart (a pool with room between pages): the
    warp-specialized kernel addresses rows through the block stride."""
    gen = torch.Generator().manual_seed(11)
    q, cache, table, qsl, lens = make_inputs([700, 64, 65], 128, gen)
    wide = torch.full((cache.shape[0], 2 * cache.shape[1], cache.shape[2]), float("nan"),
                      dtype=cache.dtype, device="cuda")  # fmt: skip
    wide[:, : cache.shape[1]] = cache
    view = wide[:, : cache.shape[1]]
    assert view.stride(0) == 2 * view.stride(1) * cache.shape[1]
    got, _ = attend(q, view, table, qsl, lens, 512, num_segments=2)
    torch.testing.assert_close(got.float(), oracle(q, cache, table, lens, 512), atol=ATOL,
                               rtol=RTOL)  # fmt: skip


def test_refusals():
    gen = torch.Generator().manual_seed(9)
    q, cache, table, qsl, lens = make_inputs([100, 100], 128, gen)
    assert hopper_reasons(q.device, torch.float32, 512, 64, HOPPER_TILES)  # not 16-bit
    assert hopper_reasons(q.device, q.dtype, 1024, 64, HOPPER_TILES)  # L over one wgmma
    # Fewer than HOPPER_MIN_HEADS heads keep the portable kernel (padding 16 heads to 64 rows
    # ties it on an H100).
    few = plan_mla(num_reqs=2, num_tokens=2, num_heads=16, max_query_len=1, max_seq_len=100,
                   dtype=q.dtype, device=q.device, latent_dims=(512, 64))  # fmt: skip
    assert not few.tiles.hopper
    # Ragged batches (prefill chunks) and long uniform ones keep the portable kernel.
    for reqs, tokens, longest in ((2, 5, 4), (1, 16, 16)):
        plan = plan_mla(num_reqs=reqs, num_tokens=tokens, num_heads=128, max_query_len=longest,
                        max_seq_len=100, dtype=q.dtype, device=q.device,
                        latent_dims=(512, 64))  # fmt: skip
        assert not plan.tiles.hopper
    big = MLATiles(64, 1, 64, 8, 3, hopper=True)  # 3 stages of 64 keys: 296 KiB
    with pytest.raises(ValueError, match="shared memory"):
        attend(q, cache, table, qsl, lens, 512, tiles=big, num_segments=1)
    with pytest.raises(ValueError, match="Hopper kernel takes"):
        MLATiles(32, 1, 64, 8, 2, hopper=True)
    with pytest.raises(ValueError, match="warp_specialized needs hopper"):
        MLATiles(64, 1, 64, 8, 2, warp_specialized=True)


def test_cuda_graph_replay_is_identical():
    gen = torch.Generator().manual_seed(10)
    batch = 8
    q, cache, table, qsl, seq_lens = make_inputs([4000] * batch, 128, gen)
    plan = plan_mla(num_reqs=batch, num_tokens=batch, num_heads=128, max_query_len=1,
                    max_seq_len=4000, dtype=q.dtype, device=q.device,
                    latent_dims=(512, 64))  # fmt: skip
    assert plan.tiles.hopper and plan.split is not None
    scratch = MLAScratch()
    scratch.ensure(batch, 128, plan.split.num_segments, 512, q.device)
    out = torch.empty(batch, 128, 512, dtype=q.dtype, device="cuda")

    def step():
        mla_attention(q, cache, table, qsl, seq_lens, SCALE, out, 512, plan=plan,
                      scratch=scratch)  # fmt: skip

    graph = capture(step)
    for lens in ([4000] * batch, [1, 9, 300, 4000, 2500, 64, 65, 0]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
        assert_replay_equals_eager(graph, step, out, lens)
        want = oracle(q, cache, table, seq_lens, 512)
        torch.testing.assert_close(out.float(), want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("query_len", [2, 4])
@pytest.mark.parametrize("num_segments", [None, 1], ids=["auto", "one"])
def test_speculative_verification(query_len, num_segments):
    """Every request has `query_len` query tokens (a draft being verified): token j sees the
    request's first `seq_len - query_len + j + 1` keys. Both Hopper kernels (pages of 64: the
    warp-specialized one; of 32: the lockstep one) against the oracle and the portable
    kernel."""
    lens = [3000, 65, 130, query_len, 64 + query_len]
    for page in (64, 32):
        gen = torch.Generator().manual_seed(query_len * page)
        _, cache, table, _, seq_lens = make_inputs(lens, 128, gen, page=page)
        num_tokens = len(lens) * query_len
        q = torch.randn(num_tokens, 128, 576, generator=gen).to(torch.bfloat16).cuda()
        qsl = torch.arange(0, num_tokens + 1, query_len, dtype=torch.int32, device="cuda")
        outs = {}
        for name, tiles in (("hopper", None), ("portable", MLATiles(64, 1, 64, 8, 2))):
            plan = plan_mla(num_reqs=len(lens), num_tokens=num_tokens, num_heads=128,
                            max_query_len=query_len, max_seq_len=max(lens), dtype=q.dtype,
                            device=q.device, tiles=tiles, num_segments=num_segments,
                            latent_dims=(512, 64))  # fmt: skip
            assert plan.tiles.hopper == (name == "hopper")
            scratch = MLAScratch()
            if plan.split is not None:
                scratch.ensure(num_tokens, 128, plan.split.num_segments, 512, q.device)
            outs[name] = torch.full((num_tokens, 128, 512), float("nan"), dtype=q.dtype,
                                    device="cuda")  # fmt: skip
            mla_attention(q, cache, table, qsl, seq_lens, SCALE, outs[name], 512, plan=plan,
                          scratch=scratch)  # fmt: skip
        want = torch.zeros(num_tokens, 128, 512, device="cuda")
        for i, seq_len in enumerate(lens):
            for j in range(query_len):
                visible = seq_len - query_len + j + 1
                pos = torch.arange(visible, device="cuda")
                keys = cache[table[i, pos // page].long(), pos % page].float()
                scores = q[i * query_len + j].float() @ keys.T * SCALE
                want[i * query_len + j] = torch.softmax(scores, -1) @ keys[:, :512]
        torch.testing.assert_close(outs["hopper"].float(), want, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(outs["hopper"].float(), outs["portable"].float(), atol=ATOL,
                                   rtol=RTOL)  # fmt: skip
