"""GPU-only checks of the MLA kernels (run through the device tool): bf16 at DeepSeek-V3 shapes
against a float32 torch oracle, and CUDA-graph capture + replay of a split-KV decode."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.graphs import assert_replay_equals_eager, capture
from unified_attn.backends.triton.mla_ops import MLAScratch, mla_attention, write_latent_cache
from unified_attn.backends.triton.mla_plan import plan_mla

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

L, R, PAGE = 512, 64, 64  # DeepSeek-V3: kv_lora_rank, rope dim, page
SCALE = 192**-0.5
# bf16 inputs and output, float32 oracle on the same bf16 values: the output's own rounding
# (2^-9 relative) plus bf16 probabilities in the value dot. Passed on an H100 and an H200
# (2026-11-23).
ATOL, RTOL = 1e-2, 2e-2


def make_inputs(computed, new, heads, gen, dtype=torch.bfloat16):
    """Request i: `computed[i]` cached tokens written with `write_latent_cache` plus `new[i]`
    new ones; a random permutation of pages."""
    seq = [c + n for c, n in zip(computed, new, strict=True)]
    pages = [-(-s // PAGE) for s in seq]
    num_blocks = sum(pages) + 1
    cache = torch.full((num_blocks, PAGE, L + R), float("nan"), dtype=dtype, device="cuda")
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(seq), max(pages) + 1, dtype=torch.int32)
    slots = []
    for i, n in enumerate(pages):
        table[i, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
        pos = torch.arange(seq[i])
        slots.append(table[i, pos // PAGE].long() * PAGE + pos % PAGE)
    latent = torch.randn(sum(seq), L + R, generator=gen).to(dtype).cuda()
    write_latent_cache(latent, cache, torch.cat(slots).cuda())
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(new), heads, L + R, generator=gen).to(dtype).cuda()
    return q, cache, table.cuda(), qsl.cuda(), torch.tensor(seq, dtype=torch.int32).cuda()


def oracle(q, cache, table, qsl, seq_lens):
    out = torch.zeros(q.shape[0], q.shape[1], L, device="cuda")
    qsl, seq_lens = qsl.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(seq_lens):
        n = qsl[i + 1] - qsl[i]
        pos = torch.arange(seq_len, device="cuda")
        keys = cache[table[i, pos // PAGE].long(), pos % PAGE].float()
        scores = torch.einsum("nhd,kd->nhk", q[qsl[i] : qsl[i + 1]].float(), keys) * SCALE
        visible = pos[None, :] <= (seq_len - n + torch.arange(n, device="cuda"))[:, None]
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        out[qsl[i] : qsl[i + 1]] = torch.softmax(scores, -1).nan_to_num(0.0) @ keys[:, :L]
    return out


def attend(q, cache, table, qsl, seq_lens, *, num_segments=None, max_seq_len=None):
    new = (qsl[1:] - qsl[:-1]).tolist()
    plan = plan_mla(
        num_reqs=len(new), num_tokens=q.shape[0], num_heads=q.shape[1], max_query_len=max(new),
        max_seq_len=max_seq_len or int(seq_lens.max()), dtype=q.dtype, device=q.device,
        num_segments=num_segments,
    )  # fmt: skip
    scratch = MLAScratch()
    if plan.split is not None:
        scratch.ensure(q.shape[0], q.shape[1], plan.split.num_segments, L, q.device)
    out = torch.empty(q.shape[0], q.shape[1], L, dtype=q.dtype, device="cuda")
    return mla_attention(q, cache, table, qsl, seq_lens, SCALE, out, L, plan=plan,
                         scratch=scratch), plan  # fmt: skip


@pytest.mark.parametrize("heads", [128, 16])
@pytest.mark.parametrize("num_segments", [None, 1], ids=["auto-split", "no-split"])
def test_bf16_decode_at_deepseek_shapes(heads, num_segments):
    gen = torch.Generator().manual_seed(0)
    inputs = make_inputs([8191, 3000, 17, 4100], [1, 1, 1, 1], heads, gen)
    got, plan = attend(*inputs, num_segments=num_segments)
    if num_segments is None:
        assert plan.split is not None  # 4 requests leave most SMs idle
    torch.testing.assert_close(got.float(), oracle(*inputs), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("heads", [128, 16])
def test_bf16_mixed_batch_at_deepseek_shapes(heads):
    gen = torch.Generator().manual_seed(1)
    inputs = make_inputs([0, 2000, 300, 5000], [200, 1, 37, 4], heads, gen)
    got, _ = attend(*inputs)
    torch.testing.assert_close(got.float(), oracle(*inputs), atol=ATOL, rtol=RTOL)


def test_float16_and_float32_run_on_the_gpu():
    for dtype, tol in ((torch.float16, 2e-3), (torch.float32, 1e-4)):
        gen = torch.Generator().manual_seed(2)
        inputs = make_inputs([700, 65, 0], [1, 3, 5], 16, gen, dtype)
        got, _ = attend(*inputs, num_segments=2)
        torch.testing.assert_close(got.float(), oracle(*inputs), atol=tol, rtol=tol)


def test_cuda_graph_replay_of_split_decode_is_identical():
    gen = torch.Generator().manual_seed(3)
    heads, batch = 128, 8
    q, cache, table, qsl, seq_lens = make_inputs([4000] * batch, [1] * batch, heads, gen)
    # Plan once for the longest context the graph may see, as a runner would.
    plan = plan_mla(num_reqs=batch, num_tokens=batch, num_heads=heads, max_query_len=1,
                    max_seq_len=4001, dtype=q.dtype, device=q.device)  # fmt: skip
    assert plan.split is not None
    scratch = MLAScratch()
    scratch.ensure(batch, heads, plan.split.num_segments, L, q.device)
    out = torch.empty(batch, heads, L, dtype=q.dtype, device="cuda")

    def step():
        mla_attention(q, cache, table, qsl, seq_lens, SCALE, out, L, plan=plan, scratch=scratch)

    graph = capture(step)
    for lens in ([4001] * batch, [1, 9, 300, 4001, 2500, 64, 65, 0]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
        assert_replay_equals_eager(graph, step, out, lens)
        torch.testing.assert_close(out.float(), oracle(q, cache, table, qsl, seq_lens),
                                   atol=ATOL, rtol=RTOL)  # fmt: skip
