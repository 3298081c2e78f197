"""The MLA kernels (`mla_ops`) against a plain-torch oracle written here: gather each request's
latent vectors through its block table, causal softmax attention in float64, values = the first
L dims.

On CPU the kernels run in Triton's interpreter (float16/float32: its bfloat16 is wrong) on small
shapes; on a GPU the same file adds bfloat16. The cache is NaN everywhere a request does not own
(the null block, stale blocks named by unused table slots, the tail of a last page), so any read
outside a request's keys shows up as a NaN output.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from unified_attn.backends.triton.mla_ops import MLAScratch, mla_attention, write_latent_cache
from unified_attn.backends.triton.mla_plan import MLATiles, plan_mla
from unified_attn.backends.triton.ops import SplitPlan

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
DTYPES = [torch.bfloat16, torch.float16] if GPU else [torch.float16, torch.float32]
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@attrs.frozen
class Batch:
    q: torch.Tensor  # [T, H, L + R]
    cache: torch.Tensor  # [num_blocks, page, L + R], a view with a block stride > one page
    block_table: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    kv_lora_rank: int

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5


def make_batch(
    computed: list[int],
    new: list[int],
    *,
    heads: int,
    page: int,
    dtype: torch.dtype,
    kv_lora_rank: int = 64,
    rope_dim: int = 16,
    padding: tuple[int, ...] = (),
    seed: int = 0,
) -> Batch:
    """Request i has `computed[i] + new[i]` keys and `new[i]` query rows; requests in `padding`
    are CUDA-graph padding rows (seq_len 0, one query row)."""
    gen = torch.Generator().manual_seed(seed)
    seq = [0 if i in padding else c + n for i, (c, n) in enumerate(zip(computed, new, strict=True))]
    pages = [-(-s // page) for s in seq]
    width = max(pages) + 2
    num_blocks = sum(pages) + 6  # block 0 is the null block; a few stale blocks stay unowned
    dim = kv_lora_rank + rope_dim
    storage = torch.full((num_blocks, page + 3, dim), float("nan"), dtype=dtype)
    cache = storage[:, :page]  # block stride larger than a page: strides must be honoured
    owned = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    # Unused slots: stale block ids (NaN pages) or the null block, never read.
    table = torch.randint(0, num_blocks, (len(seq), width), generator=gen, dtype=torch.int32)
    for i, n in enumerate(pages):
        table[i, :n] = torch.tensor(owned[:n], dtype=torch.int32)
        owned = owned[n:]
        for p in range(seq[i]):
            cache[table[i, p // page], p % page] = torch.randn(dim, generator=gen).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(new), heads, dim, generator=gen).to(dtype)
    to = {"device": DEVICE}
    return Batch(
        q.to(**to),
        cache.to(**to),
        table.to(**to),
        qsl.to(**to),
        torch.tensor(seq, dtype=torch.int32, **to),
        kv_lora_rank,
    )


def oracle(b: Batch) -> torch.Tensor:
    """float64 `[T, H, L]`: gather, causal softmax, first L dims as values; no key -> zeros."""
    q, cache, page = b.q.double().cpu(), b.cache.cpu(), b.cache.shape[1]
    out = torch.zeros(*q.shape[:2], b.kv_lora_rank, dtype=torch.float64)
    qsl, seq_lens, table = b.query_start_loc.tolist(), b.seq_lens.tolist(), b.block_table.cpu()
    for i, seq_len in enumerate(seq_lens):
        rows = slice(qsl[i], qsl[i + 1])
        n = qsl[i + 1] - qsl[i]
        pos = torch.arange(seq_len)
        keys = cache[table[i, pos // page].long(), pos % page].double()  # [seq_len, L + R]
        scores = torch.einsum("nhd,kd->nhk", q[rows], keys) * b.scale
        visible = pos[None, :] <= (seq_len - n + torch.arange(n))[:, None]  # [n, seq_len]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows without keys: all -inf
        out[rows] = torch.einsum("nhk,kd->nhd", probs, keys[:, : b.kv_lora_rank])
    return out


def run(
    b: Batch,
    *,
    num_segments: int | None = 1,
    tiles: MLATiles | None = None,
    max_seq_len: int | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    num_tokens, heads, _ = b.q.shape
    new = (b.query_start_loc[1:] - b.query_start_loc[:-1]).tolist()
    plan = plan_mla(
        num_reqs=len(new),
        num_tokens=num_tokens,
        num_heads=heads,
        max_query_len=max(new),
        max_seq_len=int(b.seq_lens.max()) if max_seq_len is None else max_seq_len,
        dtype=b.q.dtype,
        device=b.q.device,
        tiles=tiles,
        num_segments=num_segments,
        fp8_cache=kv_scale is not None,
    )
    scratch = MLAScratch()
    if plan.split is not None:
        scratch.ensure(num_tokens, heads, plan.split.num_segments, b.kv_lora_rank, b.q.device)
    out = torch.full(
        (num_tokens, heads, b.kv_lora_rank), float("nan"), dtype=b.q.dtype, device=DEVICE
    )
    got = mla_attention(
        b.q,
        b.cache,
        b.block_table,
        b.query_start_loc,
        b.seq_lens,
        b.scale,
        out,
        b.kv_lora_rank,
        plan=plan,
        scratch=scratch,
        kv_scale=kv_scale,
    )
    assert got is out
    return out


def check(b: Batch, oracle_batch: Batch | None = None, **kwargs) -> torch.Tensor:
    got = run(b, **kwargs).double().cpu()
    want = oracle(oracle_batch or b)
    assert torch.isfinite(got).all(), "unwritten rows, or a read outside a request's keys"
    err = (got - want).abs().max().item()
    assert err < TOL[b.q.dtype], f"max error {err}"
    return got


DECODE = ([40, 3, 70, 0, 17], [1, 1, 1, 1, 1])  # request 3 is a padding row (seq_len 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("num_segments", [1, 3], ids=["no-split", "split3"])
def test_decode(dtype, page, num_segments):
    b = make_batch(*DECODE, heads=16, page=page, dtype=dtype, padding=(3,))
    got = check(b, num_segments=num_segments)
    assert (got[3] == 0).all()  # the padding row sees no key


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_segments", [1, 2], ids=["no-split", "split2"])
def test_mixed_batch(dtype, num_segments):
    # prefill, decode, decode, a chunk in the middle of a sequence, a padding row, a chunk that
    # spans pages
    b = make_batch(
        [0, 17, 40, 5, 0, 30], [9, 1, 1, 6, 1, 5], heads=8, page=16, dtype=dtype, padding=(4,)
    )
    check(b, num_segments=num_segments)


@pytest.mark.parametrize(
    "tiles",
    [MLATiles(16, 1, 16, 4, 1), MLATiles(16, 2, 16, 4, 1)],
    ids=["decode-tiles", "two-queries-per-program"],
)
def test_heads_not_a_multiple_of_block_h(tiles):
    b = make_batch([21, 0, 9], [1, 4, 3], heads=20, page=16, dtype=DTYPES[0])
    check(b, tiles=tiles, num_segments=2)


@pytest.mark.parametrize(
    "page,tiles",
    [
        (24, MLATiles(16, 1, 16, 4, 1)),
        (16, MLATiles(16, 1, 32, 4, 1)),
        (32, MLATiles(16, 1, 16, 4, 1)),
    ],
    ids=["page24-per-key", "tile-spans-pages", "two-tiles-per-page"],
)
def test_page_sizes_and_tile_paths(page, tiles):
    b = make_batch([50, 0, 7], [1, 6, 1], heads=16, page=page, dtype=DTYPES[0])
    check(b, tiles=tiles, num_segments=1)
    check(b, tiles=tiles, num_segments=2)


def test_deepseek_latent_dims():
    b = make_batch(
        [70, 0, 33], [1, 3, 1], heads=16, page=64, dtype=DTYPES[0], kv_lora_rank=512, rope_dim=64
    )
    check(b, num_segments=2)


def test_uniform_query_len_spec_decode_verification():
    b = make_batch([30, 45, 0, 12], [3, 3, 3, 3], heads=8, page=16, dtype=DTYPES[0], padding=(2,))
    check(b, num_segments=None)
    check(b, num_segments=1)


def test_plan_for_shorter_contexts_stays_correct():
    # A CUDA graph is planned once; a replay may see longer contexts: the last segment takes
    # every key past the others.
    b = make_batch([100, 60], [1, 1], heads=16, page=16, dtype=DTYPES[0])
    check(b, num_segments=2, max_seq_len=32)


def test_scores_growing_along_the_context():
    # Later keys score far higher than earlier ones (by 2^40 and more): the running max keeps
    # growing, and unless the accumulator is rescaled mid-loop (in every segment) the float16
    # probabilities overflow against a stale max.
    b = make_batch([150, 90], [1, 3], heads=16, page=16, dtype=torch.float16)
    page = b.cache.shape[1]
    for i, seq_len in enumerate(b.seq_lens.tolist()):
        pos = torch.arange(seq_len, device=DEVICE)
        rows = (b.block_table[i, pos // page].long(), pos % page)
        b.cache[rows] *= (1 + pos // 16).to(b.cache.dtype)[:, None]
    want = oracle(b)
    for num_segments in (1, 3):
        got = run(b, num_segments=num_segments).double().cpu()
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < 2e-3, f"{num_segments} segments: relative error {err}"


def test_split_and_no_split_agree_closely():
    b = make_batch(*DECODE, heads=16, page=16, dtype=torch.float32 if not GPU else DTYPES[0])
    whole = run(b, num_segments=1).double()
    split = run(b, num_segments=4).double()
    assert (whole - split).abs().max().item() < TOL[b.q.dtype]


def plan(**overrides):
    batch = dict(
        num_reqs=1,
        num_tokens=1,
        num_heads=16,
        max_query_len=1,
        max_seq_len=4096,
        dtype=torch.float16,
        device=torch.device("cpu"),
    )
    return plan_mla(**{**batch, **overrides})


def test_auto_split_plan():
    # The CPU counts 4 "SMs" (see ops.num_multiprocessors); H=16 tiles run 2 programs per SM.
    few = plan()
    assert few.split is not None and few.split.num_segments > 1
    assert few.split.segment % few.tiles.block_n == 0
    assert few.split.num_segments * few.split.segment >= 4096
    assert few.uniform_query_len == 1
    assert plan(num_reqs=64, num_tokens=64).split is None  # already fills the GPU
    assert plan(max_seq_len=100).split is None  # too short to be worth a merge
    prefill = plan(num_reqs=2, num_tokens=300, max_query_len=200)
    assert prefill.split is None and prefill.uniform_query_len == 0
    assert plan(num_segments=1).split is None
    assert plan(num_segments=3).split == SplitPlan(3, 1408)
    with pytest.raises(ValueError, match="num_segments"):
        plan(num_segments=0)


def test_default_tiles():
    decode = plan(num_heads=128, dtype=torch.bfloat16).tiles
    assert (decode.block_h, decode.block_q, decode.num_warps) == (64, 1, 8)
    verify = plan(num_heads=16, max_query_len=4, num_tokens=4, dtype=torch.bfloat16).tiles
    assert verify.block_h * verify.block_q == 64
    with pytest.raises(ValueError, match="block_n"):
        MLATiles(16, 1, 24, 4, 1)
    with pytest.raises(ValueError, match=">= 16"):
        MLATiles(4, 2, 16, 4, 1)


def test_write_latent_cache_skips_padding_slots():
    dtype = DTYPES[0]
    storage = torch.zeros(4, 20, 80, dtype=dtype, device=DEVICE)
    cache = storage[:, :16]  # block stride larger than a page
    wide = torch.randn(3, 100, device=DEVICE).to(dtype)
    latent = wide[:, :80]  # rows with a stride larger than their width
    slots = torch.tensor([5, -1, 17], device=DEVICE)
    write_latent_cache(latent, cache, slots)
    assert torch.equal(cache[0, 5], latent[0]) and torch.equal(cache[1, 1], latent[2])
    written = torch.zeros(4, 20, dtype=torch.bool)
    written[0, 5] = written[1, 1] = True
    assert (storage.cpu()[~written] == 0).all()  # nothing else, not even the padding slots


def test_write_then_attend():
    b = make_batch([6], [1], heads=16, page=16, dtype=DTYPES[0])
    # Overwrite the last key through write_latent_cache: the attention must see the new row.
    row = torch.randn(1, 80, device=DEVICE).to(b.q.dtype)
    slot = b.block_table[0, 0].long() * 16 + 6
    write_latent_cache(row, b.cache, slot.reshape(1))
    assert torch.equal(b.cache[b.block_table[0, 0], 6], row[0])
    check(b)


def test_bad_inputs_are_rejected():
    b = make_batch([5], [1], heads=16, page=16, dtype=DTYPES[0])
    good = dict(
        q=b.q,
        latent_cache=b.cache,
        block_table=b.block_table,
        query_start_loc=b.query_start_loc,
        seq_lens=b.seq_lens,
        scale=0.1,
        out=torch.empty(1, 16, 64, dtype=b.q.dtype, device=DEVICE),
        kv_lora_rank=64,
        plan=plan_mla(
            num_reqs=1,
            num_tokens=1,
            num_heads=16,
            max_query_len=1,
            max_seq_len=6,
            dtype=b.q.dtype,
            device=b.q.device,
            num_segments=1,
        ),
    )
    bad = {
        "q: expected shape": dict(q=b.q[0]),
        "latent_cache: expected shape": dict(latent_cache=b.cache[..., :64]),
        "kv_lora_rank: expected a power of two": dict(kv_lora_rank=48),
        "rope dim": dict(kv_lora_rank=32),
        "out: expected shape": dict(out=torch.empty(1, 16, 80, dtype=b.q.dtype, device=DEVICE)),
        "out: expected dtype": dict(out=torch.empty(1, 16, 64, device=DEVICE).double()),
        "latent_cache: expected dtype": dict(latent_cache=b.cache.double()),
        "block_table: expected dtype": dict(block_table=b.block_table.long()),
        "query_start_loc: expected shape": dict(query_start_loc=b.query_start_loc[:1]),
        "seq_lens: expected dtype": dict(seq_lens=b.seq_lens.long()),
        "plan: expected 1 requests x 2": dict(plan=attrs.evolve(good["plan"], uniform_query_len=2)),
        "scratch: expected an MLAScratch": dict(
            plan=attrs.evolve(good["plan"], split=SplitPlan(2, 16))
        ),
    }
    for message, override in bad.items():
        args = {**good, **override}
        with pytest.raises(ValueError, match=message):
            mla_attention(**args)
    cache = b.cache
    with pytest.raises(ValueError, match="slot_mapping: expected dtype"):
        write_latent_cache(b.q[:, 0], cache, torch.zeros(1, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="latent_cache: expected shape"):
        write_latent_cache(b.q[:, 0, :64], cache, torch.zeros(1, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="slot_mapping: expected shape"):
        write_latent_cache(b.q[:, 0], cache, torch.zeros(0, dtype=torch.long, device=DEVICE))
