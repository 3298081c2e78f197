"""DeepSeek-V4's lightning-indexer scores on the Triton kernel (CPU: the interpreter) against
the reference `index_scores` (the gather + einsum the engine tests check against
transformers), and the engine's Triton backend using it."""

from __future__ import annotations

import pytest
import torch

from tests.backends.test_v4_triton import DEVICE
from unified_attn.backends.deepseek_v4_compressed import index_scores
from unified_attn.backends.triton.deepseek_v4_backend import (
    TritonDeepseekV4Backend,
    TritonLightningIndexerBackend,
)
from unified_attn.backends.triton.indexer_ops import indexer_scores


def indexer_case(seed, tokens, heads, width, dtype, index_dtype=torch.int64, entries=23):
    """Three requests' entries (random blocks of a cache of 4 entries per block) and tokens of
    random requests seeing a random prefix of them: token 2 sees none, token 3 all but the last
    of request 0, whose block (10, its own) holds stale NaN rows no token sees."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(11, 4, width, generator=gen).to(dtype)
    cache[10] = float("nan")
    blocks = torch.randint(0, 10, (3, entries), generator=gen).to(index_dtype)
    blocks[0, -1] = 10
    offsets = (torch.arange(entries) % 4).to(index_dtype)
    request = torch.randint(0, 3, (tokens,), generator=gen)
    request[3] = 0
    num_visible = torch.randint(0, entries + 1, (tokens,), generator=gen)
    num_visible[2], num_visible[3] = 0, entries - 1
    num_visible[request == 0] = num_visible[request == 0].clamp(max=entries - 1)
    q = torch.randn(tokens, heads, width, generator=gen).to(dtype)
    weights = torch.rand(tokens, heads, generator=gen)
    return [t.to(DEVICE) for t in (q, weights, cache, blocks, offsets, request, num_visible)]


@pytest.mark.parametrize(
    ("dtype", "heads", "width", "index_dtype", "tolerance"),
    [
        (torch.float32, 16, 32, torch.int64, 1e-5),
        (torch.float32, 12, 64, torch.int32, 1e-5),  # heads padded to 16
        (torch.float16, 20, 32, torch.int64, 2e-3),  # heads padded to 32
        pytest.param(torch.bfloat16, 64, 128, torch.int64, 2e-2, marks=pytest.mark.skipif(
            DEVICE == "cpu", reason="the interpreter computes bfloat16 wrongly")),  # V4's shape
    ],
)
def test_the_kernel_matches_the_reference_scores(dtype, heads, width, index_dtype, tolerance):
    case = indexer_case(0, 8, heads, width, dtype, index_dtype)
    tokens, entries = 8, case[3].shape[1]
    want = torch.empty(tokens, entries, device=DEVICE)
    got = torch.full_like(want, 123.0)
    index_scores(*case, 0.3, want)
    indexer_scores(*case, 0.3, got)
    seen = torch.isfinite(want)
    assert torch.equal(seen, torch.isfinite(got))  # -inf exactly where no entry is seen
    assert not seen[2].any() and seen[3].sum() == entries - 1
    scale = want[seen].abs().max()
    assert ((got[seen] - want[seen]).abs() <= tolerance * scale).all()


def test_more_entries_than_one_program_takes_stop_at_each_tokens_own():
    # 300 entries: three programs per token; a token seeing 70 leaves two tiles unread
    case = indexer_case(1, 5, 16, 32, torch.float32, entries=300)
    case[6][0] = 70
    want, got = (torch.empty(5, 300, device=DEVICE) for _ in range(2))
    index_scores(*case, 1.0, want)
    indexer_scores(*case, 1.0, got)
    assert torch.equal(torch.isfinite(want), torch.isfinite(got))
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.__setitem__(2, c[2].double()), r"q and cache must share one dtype"),
        (lambda c: c.__setitem__(1, c[1].half()), r"weights must be \(8, 16\).*float32"),
        (lambda c: c.__setitem__(4, c[4][:-1]), r"offsets must be \(23,\)"),
        (lambda c: c.__setitem__(5, c[5].int()), r"request must be \(8,\).*torch.int64"),
        (lambda c: c.__setitem__(2, c[2][:, :, :16]), r"cache must be \[num_blocks"),
    ],
)
def test_bad_inputs_are_refused_naming_the_tensor(change, message):
    case = indexer_case(2, 8, 16, 32, torch.float32)
    change(case)
    with pytest.raises(ValueError, match=message):
        indexer_scores(*case, 1.0, torch.empty(8, 23, device=DEVICE))


def test_the_triton_backend_scores_with_the_kernel():
    assert TritonDeepseekV4Backend.cache_user_classes()["indexer"] is TritonLightningIndexerBackend
    assert TritonLightningIndexerBackend.score_entries is indexer_scores
