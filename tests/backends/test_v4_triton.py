"""DeepSeek-V4 on the Triton kernels (CPU: the interpreter): `gathered_attention` against the
reference partial attention, then a tiny V4 checkpoint through the engine on
`triton-deepseek-v4` against the reference backends (which match transformers:
tests/models/test_deepseek_v4_hf.py) with chunked prefill that cuts compression windows."""

from __future__ import annotations

import attrs
import pytest
import torch

from tests.models.hf_models import save_hf_model
from tests.models.test_deepseek_v4_hf import MEMORY, make_v4
from unified_attn import LLMEngine, SamplingParams
from unified_attn.backends.deepseek_v4_steps import (
    GatheredRows,
    attend_row_sets,
    partial_attention,
)
from unified_attn.backends.triton.deepseek_v4_backend import (
    TritonCompressedAttentionBackend,
    TritonDeepseekV4Backend,
)
from unified_attn.backends.triton.v4_ops import (
    SM90_SHARED_BYTES,
    GatherConfig,
    Sm90GatherConfig,
    gathered_attention,
    gathered_attention_sets,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def gathered_case(seed, tokens, heads, width, num_blocks, block_size, rows, dtype):
    """Random queries and cache, and per-token lists of (block, slot) rows about 70% visible;
    a stale NaN row no token sees, and token 2 sees nothing (lse -inf, output 0)."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_blocks, block_size, width, generator=gen).to(dtype)
    cache[3, 2, 5] = float("nan")
    q = torch.randn(tokens, heads, width, generator=gen).to(dtype)
    blocks = torch.randint(0, num_blocks, (tokens, rows), generator=gen)
    offsets = torch.randint(0, block_size, (tokens, rows), generator=gen)
    valid = (torch.rand(tokens, rows, generator=gen) > 0.3) & ~((blocks == 3) & (offsets == 2))
    valid[2] = False
    return q, cache, blocks, offsets, valid



def row_sets_case(seed, tokens, heads, width, dtype, rows=(20, 45)):
    """Two sets of rows from two caches of different block sizes (a window cache and a
    compressed cache, as a CSA layer hands them over): each about 70% visible, a stale NaN row
    nobody sees, and token 2 sees nothing in either set (its output is 0: the sink's)."""
    q, window, w_blocks, w_offsets, w_valid = gathered_case(seed, tokens, heads, width, 12, 8,
                                                            rows[0], dtype)  # fmt: skip
    _, entries, c_blocks, c_offsets, c_valid = gathered_case(seed + 1, tokens, heads, width, 9,
                                                             4, rows[1], dtype)  # fmt: skip
    return q, [GatheredRows(window, w_blocks, w_offsets, w_valid),
               GatheredRows(entries, c_blocks, c_offsets, c_valid)]  # fmt: skip


@pytest.mark.parametrize("sets", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_layer_attention_over_row_sets_matches_the_reference(sets, dtype):
    tokens, heads, width = 5, 20, 64
    q, row_sets = row_sets_case(3, tokens, heads, width, dtype)
    row_sets = row_sets[:sets]
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(9)) * 3
    on_device = [GatheredRows(*(t.to(DEVICE) for t in (r.cache, r.blocks, r.offsets, r.visible)))
                 for r in row_sets]  # fmt: skip
    out = torch.full_like(q, float("nan"), device=DEVICE)
    gathered_attention_sets(q.to(DEVICE), on_device, 0.125, sinks.to(DEVICE), out)
    want = torch.empty(tokens, heads, width)
    attend_row_sets(q.float(), [GatheredRows(r.cache.float(), r.blocks, r.offsets, r.visible)
                                for r in row_sets], 0.125, sinks, want)  # fmt: skip
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.cpu().float(), want, rtol=tol, atol=tol)
    assert (out[2] == 0).all()


def test_the_layer_attention_refuses_bad_sets_and_sinks():
    q, row_sets = row_sets_case(3, 4, 8, 64, torch.float32)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="at least one set of rows"):
        gathered_attention_sets(q, [], 0.1, torch.zeros(8), out)
    with pytest.raises(ValueError, match=r"sinks \[8\] on cpu, got \(4, 8, 64\) and \(3,\)"):
        gathered_attention_sets(q, row_sets, 0.1, torch.zeros(3), out)
    bad = GatheredRows(row_sets[1].cache, row_sets[1].blocks, row_sets[1].offsets,
                       row_sets[1].visible.int())  # fmt: skip
    with pytest.raises(ValueError, match=r"visible must be torch\.bool"):
        gathered_attention_sets(q, [row_sets[0], bad], 0.1, torch.zeros(8), out)
    short = GatheredRows(*attrs.astuple(row_sets[1], recurse=False)[:4], torch.zeros(3))
    with pytest.raises(ValueError, match=r"lengths must be \[4\] of .* got \(3,\) torch.float32"):
        gathered_attention_sets(q, [row_sets[0], short], 0.1, torch.zeros(8), out)

@pytest.mark.parametrize(
    ("dtype", "index_dtype", "config"),
    [
        (torch.float32, torch.int64, None),
        (torch.float16, torch.int64, None),
        # 16-row tiles, two head groups, each tile's list entries loaded in its own iteration
        (torch.float32, torch.int32, GatherConfig(16, 16, 4, 2, index_ahead=False)),
        (torch.float16, torch.int32, GatherConfig(16, 16, 4, 3)),
        (torch.float16, torch.int64, GatherConfig(32, 32, 4, 2, max_registers=128)),
        # three parts of each list on their own programs, merged after (the last one short)
        (torch.float32, torch.int64, GatherConfig(16, 16, 4, 2, splits=3)),
        (torch.float16, torch.int32, GatherConfig(32, 16, 4, 3, splits=0)),
    ],
)
def test_gathered_attention_matches_the_reference_partial(dtype, index_dtype, config):
    tokens, heads = 5, 20  # 20 heads: 16 + 4
    q, cache, blocks, offsets, valid = gathered_case(0, tokens, heads, 64, 12, 8, 45, dtype)
    args = [t.to(DEVICE) for t in (q, cache, blocks.to(index_dtype), offsets.to(index_dtype))]
    out, lse = torch.empty_like(args[0]), torch.empty(tokens, heads, device=DEVICE)
    gathered_attention(*args, valid.to(DEVICE), 0.125, out, lse, config)
    want_out, want_lse = torch.empty_like(q), torch.empty(tokens, heads)
    partial_attention(q, cache[blocks, offsets], valid, 0.125, want_out, want_lse)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.cpu().float(), want_out.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=1e-5, atol=1e-5)
    assert lse[2].isneginf().all() and (out[2] == 0).all()


def test_a_list_of_no_rows_gives_zero_outputs_and_no_mass():
    q = torch.randn(3, 4, 32, device=DEVICE)
    out, lse = torch.full_like(q, 7.0), torch.zeros(3, 4, device=DEVICE)
    none = torch.zeros(3, 0, dtype=torch.long, device=DEVICE)
    gathered_attention(q, torch.randn(2, 4, 32, device=DEVICE), none, none,
                       none.bool(), 1.0, out, lse)  # fmt: skip
    assert (out == 0).all() and lse.isneginf().all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal off sm90 (CPU)")
def test_the_hopper_configuration_is_refused_off_sm90():
    q = torch.randn(2, 4, 128)
    with pytest.raises(ValueError, match="Sm90GatherConfig needs an sm90 GPU"):
        gathered_attention(q, torch.randn(3, 4, 128), *[torch.zeros(2, 5, dtype=torch.long)] * 2,
                           torch.ones(2, 5, dtype=torch.bool), 1.0, torch.empty_like(q),
                           torch.empty(2, 4), Sm90GatherConfig())  # fmt: skip


def test_gathered_attention_names_what_is_wrong():
    q = torch.randn(2, 4, 24)
    with pytest.raises(ValueError, match="head size 24 is not a power of two"):
        gathered_attention(q, torch.randn(3, 4, 24), *[torch.zeros(2, 5, dtype=torch.long)] * 2,
                           torch.ones(2, 5, dtype=torch.bool), 1.0, torch.empty_like(q),
                           torch.empty(2, 4))  # fmt: skip
    q = torch.randn(2, 4, 32)
    with pytest.raises(ValueError, match="blocks and offsets must share one dtype"):
        gathered_attention(q, torch.randn(3, 4, 32), *[torch.zeros(2, 5)] * 2,
                           torch.ones(2, 5, dtype=torch.bool), 1.0, torch.empty_like(q),
                           torch.empty(2, 4))  # fmt: skip


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: GatherConfig(24, 64, 8, 3),
            "GatherConfig.heads must be a power of two >= 16, got 24",
        ),
        (lambda: GatherConfig(32, 64, 8, 0), "GatherConfig.num_stages must be an int >= 1, got 0"),
        (
            lambda: GatherConfig(32, 64, 8, 3, splits=-1),
            "GatherConfig.splits must be an int >= 0, got -1",
        ),
        (
            lambda: Sm90GatherConfig(tile=48),
            "Sm90GatherConfig.tile must be a power of two >= 16, got 48",
        ),
        (
            lambda: Sm90GatherConfig(num_stages=1),
            "Sm90GatherConfig.num_stages must be an int >= 2, got 1",
        ),
        (
            lambda: Sm90GatherConfig(halves=3),
            r"Sm90GatherConfig.halves must be an int in \[0, 2\], got 3",
        ),
    ],
)
def test_kernel_configurations_name_the_bad_field(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_the_hopper_configurations_shared_memory_is_counted():
    # The query (64 heads), the ring and the probabilities: 200 KiB by default at V4's width
    # (the compiler reports 205312 bytes, 512 of them scratch); a third 64-row buffer is over.
    assert Sm90GatherConfig().shared_bytes(512) == 204800
    assert Sm90GatherConfig(32, 4).shared_bytes(512) == 200704
    assert Sm90GatherConfig(64, 3).shared_bytes(512) + 1024 > SM90_SHARED_BYTES


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_hf_model(make_v4(), tmp_path_factory.mktemp("v4-triton"))


def test_the_engine_on_triton_matches_the_reference_backends(checkpoint):
    prompts = [[(7 * i + 3 * j) % 120 + 3 for j in range(n)] for i, n in enumerate([37, 9])]
    params = SamplingParams(max_tokens=6, ignore_eos=True, prompt_logits=True, return_logits=True)
    outputs = {}
    for backend in ("deepseek-v4-reference", "triton-deepseek-v4"):
        engine = LLMEngine(str(checkpoint), backend=backend, max_num_batched_tokens=13,
                           block_size=8, kv_cache_memory=MEMORY, device=DEVICE,
                           dtype="float32")  # fmt: skip
        outputs[backend] = engine.generate(prompts, params)
    assert engine.backend_cls is TritonDeepseekV4Backend
    assert engine.backend_cls.cache_user_classes()["compressed"] is TritonCompressedAttentionBackend
    for ref, got in zip(*outputs.values(), strict=True):
        assert got.output_token_ids == ref.output_token_ids
        assert (got.prompt_logits - ref.prompt_logits).abs().max() < 1e-4
        assert (got.logits - ref.logits).abs().max() < 1e-4
