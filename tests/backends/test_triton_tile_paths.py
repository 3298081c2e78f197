"""The Triton kernel's tile paths, forced with small tiles so that short sequences reach them.

The kernel walks a program's keys in three kinds of tile: masked ones at the edges of its key
range (window start, causal diagonal, sequence end), unmasked ones that every query row of the
program sees whole, and, when a tile lies inside one page (`block_size % TILE == 0`), tiles
addressed by one block-table entry instead of one per key. The shipped tiles (32-64 keys) need
hundreds of tokens to reach the unmasked path; here 16- and 32-key tiles with 8-token query
blocks reach every path on the CPU interpreter. Each case is checked against the reference math
(`run_case`) or SDPA (`check_encoder`).
"""

import functools

import pytest
import torch

from tests.backends import test_fp8_triton as fp8_cases
from tests.backends import test_triton_encoder as encoder_cases
from tests.backends.test_triton_kernels import DEVICE, DTYPES, run_case
from unified_attn.backend import AttentionType
from unified_attn.backends.reference import ReferenceAttentionBackend
from unified_attn.backends.triton import TritonAttentionBackend, ops
from unified_attn.backends.triton.ops import SplitPlan, TileConfig

# (tile config, block size): page-addressed tiles (16 in 16, 16 in 32) and per-key ones (32 in 16)
TILE_16, TILE_32 = TileConfig(16, 16, 4, 2), TileConfig(16, 32, 4, 2)
TILES = [(TILE_16, 16), (TILE_16, 32), (TILE_32, 16)]
TILE_IDS = ["tile16-page16", "tile16-page32", "tile32-page16"]
# prefill of 50, chunked prefill of 21 after 70, decode after 45, prefill of 9: whole tiles
# inside each program's range, diagonal tiles and partial tiles at the sequence ends
COMPUTED, NEW = [0, 70, 45, 0], [50, 21, 1, 9]


@pytest.fixture(params=TILES, ids=TILE_IDS)
def forced_tile(request, monkeypatch):
    cfg, block_size = request.param
    monkeypatch.setattr(ops, "tile_config", lambda *args, **kwargs: cfg)
    return block_size


FEATURES = [
    dict(),
    dict(window=20),
    dict(window=37, sinks=True),
    dict(chunk=16),
    dict(chunk=24, soft_cap=4.0),
    dict(window=20, sink_tokens=5),
    dict(batch_invariant=True),
    dict(batch_invariant=True, window=20),
]
FEATURE_IDS = ["full", "window", "window+sinks", "chunk", "chunk+softcap", "streaming",
               "invariant", "invariant+window"]  # fmt: skip


@pytest.mark.parametrize("features", FEATURES, ids=FEATURE_IDS)
def test_causal_batches_on_every_tile_path(forced_tile, features):
    run_case(hq=4, hkv=2, d=32, bs=forced_tile, computed=COMPUTED, new=NEW, dtype=DTYPES[0],
             **features)  # fmt: skip


@pytest.mark.parametrize("window", [None, 24])
def test_split_kv_decode_on_every_tile_path(forced_tile, window):
    run_case(hq=4, hkv=2, d=32, bs=forced_tile, computed=[70, 3, 129, 40], new=[1, 1, 1, 1],
             dtype=DTYPES[0], window=window, sinks=True,
             split=SplitPlan(num_segments=4, segment=32))  # fmt: skip


def test_padded_head_size_on_every_tile_path(forced_tile):
    # 48 is padded to 64 lanes: unmasked tiles still mask the padding dimensions
    run_case(hq=2, hkv=1, d=48, bs=forced_tile, computed=COMPUTED, new=NEW, dtype=DTYPES[0])


def test_encoder_on_every_tile_path(forced_tile):
    encoder_cases.check_encoder(AttentionType.ENCODER_ONLY, [40, 3, 57], 4, 2, 32, DTYPES[0],
                                fused=True)  # fmt: skip


@pytest.mark.parametrize(
    "features",
    [dict(sliding_window=6), dict(chunk_size=16), dict(logits_soft_cap=2.0)],
    ids=["window", "chunked", "softcap"],
)
def test_encoder_masks_on_every_tile_path(forced_tile, features):
    layer = encoder_cases.layer_of(AttentionType.ENCODER_ONLY, 4, 2, 32, **features)
    lengths = [40, 3, 57]
    q, k, v = encoder_cases.packed_qkv(sum(lengths), layer, DTYPES[0], DEVICE, fused=True)
    run = functools.partial(encoder_cases.run_encoder, layer=layer, lengths=lengths, q=q, k=k,
                            v=v, dtype=DTYPES[0])  # fmt: skip
    got = run(TritonAttentionBackend)
    expected = run(ReferenceAttentionBackend)
    encoder_cases.assert_close(got, expected, f"{features}")


def test_fp8_cache_on_every_tile_path(forced_tile):
    fp8_cases.run_case(hq=4, hkv=2, d=32, bs=forced_tile, computed=COMPUTED, new=NEW,
                       dtype=DTYPES[0], window=20)  # fmt: skip


@pytest.mark.parametrize("features", [dict(), dict(window=20, sinks=True)], ids=["full", "window"])
def test_float32_on_every_tile_path(forced_tile, features):
    # float32 dots take another code path on the GPU (no tensor cores under "ieee")
    run_case(hq=4, hkv=2, d=32, bs=forced_tile, computed=COMPUTED, new=NEW, dtype=torch.float32,
             **features)  # fmt: skip



def test_fp8_decode_under_a_register_cap(monkeypatch):
    # the shipped fp8 decode tile caps registers (Triton's `maxnreg`); the cap changes code
    # generation on the GPU only, where tests/gpu/test_fp8_kv_gpu.py runs it
    cfg = ops.tile_config(2, 32, 1, torch.float16, fp8=True)
    assert cfg.max_registers == 128
    fp8_cases.run_case(hq=4, hkv=2, d=32, bs=16, computed=[70, 3, 129, 40], new=[1, 1, 1, 1],
                       dtype=DTYPES[0])  # fmt: skip
