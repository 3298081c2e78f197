"""GPU-only checks of the Hopper fp8 MLA decode kernel (kernels/mla_decode_sm90_fp8.py, run
through the device tool on an sm90 GPU): an e4m3 latent cache with a scale against a float32
oracle over the dequantized latents, and against the portable kernel's fp8 path; bf16 and
float16 queries (bf16 rows beyond float16's range), split-KV, padded head groups, empty and
one-key requests, several page sizes and latent widths, speculative verification and
CUDA-graph replay. Unwritten cache rows hold NaN bytes."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.graphs import assert_replay_equals_eager, capture
from tests.gpu.test_mla_hopper_gpu import SCALE, make_inputs
from unified_attn.backends.kv_quant import dequantize_fp8, quantize_fp8
from unified_attn.backends.triton.mla_ops import MLAScratch, mla_attention
from unified_attn.backends.triton.mla_plan import HOPPER_TILES, MLATiles, plan_mla
from unified_attn.backends.triton.mla_sm90 import hopper_reasons

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not SM90, reason="needs an sm90 GPU")

# Against a float32 oracle on the same fp8 values: the output's rounding plus float16
# probabilities in the value product.
ATOL, RTOL = 1e-2, 2e-2
KV_SCALE = 4.0 / 448  # random latents beyond 4 saturate


def fp8_inputs(seq_lens, heads, gen, **kwargs):
    """`make_inputs` with the cache quantized to e4m3 (NaN rows stay NaN) and its scale."""
    q, cache, table, qsl, lens = make_inputs(seq_lens, heads, gen, **kwargs)
    kv_scale = torch.tensor(KV_SCALE, device="cuda")
    return q, quantize_fp8(cache, kv_scale), table, qsl, lens, kv_scale


def oracle(q, cache, table, seq_lens, L, kv_scale, query_len=1):
    """Softmax attention of each query token over its visible dequantized latents."""
    page = cache.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], L, device="cuda")
    for t in range(q.shape[0]):
        i, j = divmod(t, query_len)
        visible = int(seq_lens[i]) - query_len + j + 1
        pos = torch.arange(visible, device="cuda")
        keys = dequantize_fp8(cache[table[i, pos // page].long(), pos % page], kv_scale)
        scores = torch.einsum("hd,kd->hk", q[t].float(), keys) * SCALE
        out[t] = torch.softmax(scores, -1).nan_to_num(0.0) @ keys[:, :L]
    return out


def attend(q, cache, table, qsl, seq_lens, L, kv_scale, *, tiles=None, num_segments=None,
           query_len=1):  # fmt: skip
    num_reqs = seq_lens.shape[0]
    plan = plan_mla(
        num_reqs=num_reqs, num_tokens=q.shape[0], num_heads=q.shape[1], max_query_len=query_len,
        max_seq_len=max(int(seq_lens.max()), 1), dtype=q.dtype, device=q.device, tiles=tiles,
        num_segments=num_segments, latent_dims=(L, q.shape[2] - L), fp8_cache=True,
    )  # fmt: skip
    scratch = MLAScratch()
    if plan.split is not None:
        scratch.ensure(q.shape[0], q.shape[1], plan.split.num_segments, L, q.device)
    out = torch.full((q.shape[0], q.shape[1], L), float("nan"), dtype=q.dtype, device="cuda")
    mla_attention(q, cache, table, qsl, seq_lens, SCALE, out, L, plan=plan, scratch=scratch,
                  kv_scale=kv_scale)  # fmt: skip
    return out, plan


@pytest.mark.parametrize("heads", [128, 64, 96, 32])  # 32: one padded program
@pytest.mark.parametrize("num_segments", [None, 1, 3], ids=["auto", "one", "three"])
def test_fp8_decode_matches_the_oracle(heads, num_segments):
    gen = torch.Generator().manual_seed(heads)
    q, cache, table, qsl, lens, kv_scale = fp8_inputs([8191, 3000, 17, 4100, 64, 65, 1, 0],
                                                      heads, gen)  # fmt: skip
    got, plan = attend(q, cache, table, qsl, lens, 512, kv_scale, num_segments=num_segments)
    assert plan.tiles == HOPPER_TILES
    want = oracle(q, cache, table, lens, 512, kv_scale)
    torch.testing.assert_close(got.float(), want, atol=ATOL, rtol=RTOL)
    unscaled = oracle(q, cache, table, lens, 512, torch.tensor(1.0, device="cuda"))
    assert (got.float() - unscaled).abs().max() > 0.5  # the scale is really applied


@pytest.mark.parametrize("page", [16, 1, 128])
def test_any_page_size(page):
    gen = torch.Generator().manual_seed(page)
    q, cache, table, qsl, lens, kv_scale = fp8_inputs([1000, 129, 31], 128, gen, page=page)
    got, _ = attend(q, cache, table, qsl, lens, 512, kv_scale, num_segments=2)
    want = oracle(q, cache, table, lens, 512, kv_scale)
    torch.testing.assert_close(got.float(), want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(("L", "R", "dtype"), [(256, 32, torch.bfloat16), (128, 16, torch.float16),
                                               (512, 64, torch.float16)])  # fmt: skip
def test_other_latent_widths_and_float16(L, R, dtype):
    gen = torch.Generator().manual_seed(L + R)
    q, cache, table, qsl, lens, kv_scale = fp8_inputs([700, 65, 5, 0], 64, gen, L=L, R=R,
                                                      dtype=dtype)  # fmt: skip
    got, plan = attend(q, cache, table, qsl, lens, L, kv_scale, num_segments=1)
    assert plan.tiles.hopper
    want = oracle(q, cache, table, lens, L, kv_scale)
    torch.testing.assert_close(got.float(), want, atol=ATOL, rtol=RTOL)


def test_bf16_queries_beyond_float16_range():
    # Rows above 2^14 are divided by a power of two before their float16 products.
    gen = torch.Generator().manual_seed(5)
    q, cache, table, qsl, lens, kv_scale = fp8_inputs([900, 70, 3], 128, gen)
    q = q * torch.tensor([3e4, 1.0, 5e5], device="cuda").to(q.dtype)[:, None, None]
    q[1, 7] *= 2e4  # one head of one token
    got, _ = attend(q, cache, table, qsl, lens, 512, kv_scale, num_segments=1)
    want = oracle(q, cache, table, lens, 512, kv_scale)
    assert torch.isfinite(got).all()
    err = (got.float() - want).abs().amax(-1) / want.abs().amax(-1).clamp(min=1e-6)
    assert err.max() < 0.05


@pytest.mark.parametrize("num_segments", [1, 3])
def test_the_hopper_and_portable_fp8_kernels_agree(num_segments):
    gen = torch.Generator().manual_seed(8)
    inputs = fp8_inputs([4096, 1500, 800, 3, 130], 128, gen)
    hopper, plan = attend(*inputs[:5], 512, inputs[5], num_segments=num_segments)
    portable, other = attend(*inputs[:5], 512, inputs[5], tiles=MLATiles(64, 1, 64, 8, 2),
                             num_segments=num_segments)  # fmt: skip
    assert plan.tiles.hopper and not other.tiles.hopper
    torch.testing.assert_close(hopper.float(), portable.float(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("query_len", [2, 4])
def test_speculative_verification(query_len):
    lens = [3000, 65, 130, query_len, 64 + query_len]
    gen = torch.Generator().manual_seed(query_len)
    _, cache, table, _, seq_lens, kv_scale = fp8_inputs(lens, 128, gen, page=32)
    num_tokens = len(lens) * query_len
    q = torch.randn(num_tokens, 128, 576, generator=gen).to(torch.bfloat16).cuda()
    qsl = torch.arange(0, num_tokens + 1, query_len, dtype=torch.int32, device="cuda")
    got, plan = attend(q, cache, table, qsl, seq_lens, 512, kv_scale, query_len=query_len)
    assert plan.tiles.hopper
    want = oracle(q, cache, table, seq_lens, 512, kv_scale, query_len)
    torch.testing.assert_close(got.float(), want, atol=ATOL, rtol=RTOL)


def test_shared_memory_refusal():
    assert hopper_reasons(torch.device("cuda"), torch.bfloat16, 512, 64, HOPPER_TILES,
                          fp8_cache=True) == []  # fmt: skip
    # R = 128: the query and two float16 tiles of 64 x 640 features take 248 KiB
    reasons = hopper_reasons(torch.device("cuda"), torch.bfloat16, 512, 128, HOPPER_TILES,
                             fp8_cache=True)  # fmt: skip
    assert "shared memory" in " ".join(reasons)


def test_cuda_graph_replay_is_identical():
    gen = torch.Generator().manual_seed(10)
    batch = 8
    q, cache, table, qsl, seq_lens, kv_scale = fp8_inputs([4000] * batch, 128, gen)
    plan = plan_mla(num_reqs=batch, num_tokens=batch, num_heads=128, max_query_len=1,
                    max_seq_len=4000, dtype=q.dtype, device=q.device, latent_dims=(512, 64),
                    fp8_cache=True)  # fmt: skip
    assert plan.tiles.hopper and plan.split is not None
    scratch = MLAScratch()
    scratch.ensure(batch, 128, plan.split.num_segments, 512, q.device)
    out = torch.empty(batch, 128, 512, dtype=q.dtype, device="cuda")

    def step():
        mla_attention(q, cache, table, qsl, seq_lens, SCALE, out, 512, plan=plan,
                      scratch=scratch, kv_scale=kv_scale)  # fmt: skip

    graph = capture(step)
    for lens in ([4000] * batch, [1, 9, 300, 4000, 2500, 64, 65, 0]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
        kv_scale.fill_(KV_SCALE * (2.0 if lens[0] == 1 else 1.0))  # read on the device
        assert_replay_equals_eager(graph, step, out, lens)
        want = oracle(q, cache, table, seq_lens, 512, kv_scale)
        torch.testing.assert_close(out.float(), want, atol=ATOL, rtol=RTOL)
