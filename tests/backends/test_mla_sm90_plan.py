"""Which MLA kernel a batch gets, from host values alone (`plan_mla`, `mla_sm90`): the Hopper
kernels' choice and refusals, checked anywhere (their numerics run in tests/gpu/
test_mla_hopper_gpu.py on an sm90 GPU)."""

from __future__ import annotations

import pytest
import torch

from unified_attn.backends.triton.mla_ops import MLAScratch, mla_attention
from unified_attn.backends.triton.mla_plan import HOPPER_TILES, MLATiles, plan_mla
from unified_attn.backends.triton.mla_sm90 import (
    hopper_reasons,
    warp_specialized_fits,
    ws_shared_bytes,
)
from unified_attn.backends.triton.ops import SM90_SHARED_BYTES

LOCKSTEP = MLATiles(64, 1, 64, 8, 2, hopper=True)


def cache(num_blocks=4, page=64, dim=576, spread=1, dtype=torch.bfloat16):
    """[num_blocks, page, dim]; with spread > 1 a view whose blocks are `spread` pages apart."""
    return torch.zeros(num_blocks, page * spread, dim, dtype=dtype)[:, :page]


def test_tiles_validate_the_hopper_fields():
    with pytest.raises(ValueError, match="warp_specialized needs hopper"):
        MLATiles(64, 1, 64, 8, 2, warp_specialized=True)
    with pytest.raises(ValueError, match="Hopper kernel takes"):
        MLATiles(64, 2, 64, 8, 2, hopper=True)
    with pytest.raises(ValueError, match="Hopper kernel takes"):
        MLATiles(64, 1, 64, 8, 1, hopper=True)  # a ring needs two stages
    assert HOPPER_TILES.hopper and HOPPER_TILES.warp_specialized


def test_warp_specialized_fits_the_cache_layout():
    assert warp_specialized_fits(cache(), 512, HOPPER_TILES)
    assert warp_specialized_fits(cache(page=128), 512, HOPPER_TILES)
    assert warp_specialized_fits(cache(spread=3), 512, HOPPER_TILES)  # blocks 3 pages apart
    assert not warp_specialized_fits(cache(page=32), 512, HOPPER_TILES)  # a tile spans pages
    assert not warp_specialized_fits(cache(), 512, LOCKSTEP)  # not asked for
    assert not warp_specialized_fits(cache(dim=640), 512, HOPPER_TILES)  # R 128: 245 KiB
    odd = torch.zeros(4, 64 * 576 + 8, dtype=torch.bfloat16)[:, : 64 * 576].view(4, 64, 576)
    assert not warp_specialized_fits(odd, 512, HOPPER_TILES)  # blocks not whole rows apart


def test_shared_memory_of_the_warp_specialized_kernel():
    # The query, two stages of latent halves and rope rows, probabilities and statistics.
    assert ws_shared_bytes(512, 64) == 2 * (64 * 512 + 2 * 64 * 576 + 2 * 64 * 64) + 1536 + 64
    assert ws_shared_bytes(512, 64) + 1024 <= SM90_SHARED_BYTES
    assert ws_shared_bytes(512, 128) + 1024 > SM90_SHARED_BYTES


def test_hopper_reasons_name_each_misfit():
    cpu = torch.device("cpu")
    reasons = hopper_reasons(cpu, torch.float32, 1024, 8, HOPPER_TILES)
    text = "; ".join(reasons)
    for part in ("not an sm90 GPU", "not 16-bit", "kv_lora_rank 1024", "rope dim 8"):
        assert part in text
    big = MLATiles(64, 1, 64, 8, 3, hopper=True)
    assert any("shared memory" in r for r in hopper_reasons(cpu, torch.bfloat16, 512, 64, big))


def test_plan_picks_the_portable_kernel_off_hopper():
    plan = plan_mla(num_reqs=4, num_tokens=4, num_heads=128, max_query_len=1, max_seq_len=100,
                    dtype=torch.float16, device=torch.device("cpu"),
                    latent_dims=(512, 64))  # fmt: skip
    assert not plan.tiles.hopper


def test_hopper_tiles_off_hopper_are_refused_with_the_reason():
    q = torch.zeros(2, 64, 576, dtype=torch.float16)
    lat = cache(dtype=torch.float16)
    table = torch.zeros(2, 1, dtype=torch.int32)
    qsl = torch.arange(3, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    plan = plan_mla(num_reqs=2, num_tokens=2, num_heads=64, max_query_len=1, max_seq_len=1,
                    dtype=q.dtype, device=q.device, tiles=HOPPER_TILES, num_segments=1)  # fmt: skip
    out = torch.empty(2, 64, 512, dtype=q.dtype)
    with pytest.raises(ValueError, match="Hopper MLA kernel cannot run this batch: device cpu"):
        mla_attention(q, lat, table, qsl, lens, 0.1, out, 512, plan=plan, scratch=MLAScratch())
