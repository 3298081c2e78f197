"""Host planning of DeepSeek MLA attention (`mla_ops.py` launches it): the launch shape of one
program (`MLATiles`), the default tiles (`mla_tiles`, `HOPPER_TILES`) and the plan of one batch
(`plan_mla`: tiles, which kernel, split-KV segments by `auto_segments`). Host values only: a plan
reads no device value, so it can be made before a CUDA-graph capture.
"""

from __future__ import annotations

import attrs
import torch
import triton

from unified_attn.backends.triton.mla_sm90 import HOPPER_MAX_QUERY_LEN, hopper_reasons
from unified_attn.backends.triton.ops import SplitPlan, num_multiprocessors
from unified_attn.utils import cdiv, power_of_two

MAX_SEGMENTS = 64
# Fewest heads for which decode takes a Hopper kernel (64 rows a program; fewer heads are padded
# with masked rows). H100, B 64, 8k, bf16: 32 heads padded take 229 us against the portable
# kernel's 314 (32k: 821 against 1180); fp8 277 against 712. At 16 heads the padded kernel
# ties the portable one (227 us), which keeps them.
HOPPER_MIN_HEADS = 32
MAX_UNIFORM_QUERY_LEN = 16  # longer uniform batches take the ragged path (one compile for all)
SPLIT_MAX_QUERY_LEN = 8  # decode and spec-decode verification may split; prefill never does
SEGMENT_ROUND = 64  # segments are multiples of this many keys (and of the tile)


@attrs.frozen
class MLATiles:
    """Launch shape of one MLA program: BLOCK_Q tokens x BLOCK_H heads against BLOCK_N keys."""

    block_h: int = attrs.field(validator=power_of_two(1, "heads per program"))
    block_q: int = attrs.field(validator=power_of_two(1, "query tokens per program"))
    block_n: int = attrs.field(validator=power_of_two(16, "keys per tile"))
    num_warps: int = attrs.field(validator=power_of_two(1, "warps"))
    num_stages: int = attrs.field(validator=attrs.validators.ge(1))
    # Programs one SM runs at once (what the split plan fills the GPU with).
    programs_per_sm: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    # A Hopper decode kernel (mla_sm90.py) instead of the portable one; with warp_specialized
    # the warp-specialized one wherever the cache allows it (pages of a multiple of 64 keys).
    hopper: bool = False
    warp_specialized: bool = False
    # Portable kernel: products with the keys as the MMA rows (scores^T = c q^T, out^T = c^T
    # p^T), so 16 heads fill the N side instead of padding the M side: used for 16-row tiles
    # over an fp8 cache, whose dequantized tile otherwise spills.
    swap_ab: bool = False

    def __attrs_post_init__(self) -> None:
        if self.block_h * self.block_q < 16:
            raise ValueError(
                f"MLATiles: block_h * block_q must be >= 16 (a tensor-core tile), got "
                f"{self.block_h} * {self.block_q}"
            )
        if self.warp_specialized and not self.hopper:
            raise ValueError(f"MLATiles: warp_specialized needs hopper=True, got {self}")
        if self.swap_ab and self.hopper:
            raise ValueError(f"MLATiles: swap_ab is a portable-kernel option, got {self}")
        shape = (self.block_h, self.block_q, self.num_warps, self.programs_per_sm)
        if self.hopper and (
            shape != (64, 1, 8, 1) or self.block_n not in (32, 64) or self.num_stages < 2
        ):
            raise ValueError(
                "MLATiles: the Hopper kernel takes block_h 64, block_q 1, block_n 32 or 64, "
                f"8 warps, at least 2 stages and 1 program per SM, got {self}"
            )

    def shared_bytes(self, kv_lora_rank: int, rope_dim: int) -> int:
        """Shared memory of one Hopper program (2-byte data): the query, the ring of key tiles
        and the probabilities."""
        dim = kv_lora_rank + rope_dim
        return 2 * (64 * dim + self.num_stages * self.block_n * dim + 64 * self.block_n)

    @property
    def block_m(self) -> int:
        return self.block_h * self.block_q


def mla_tiles(
    num_heads: int, max_query_len: int, dtype: torch.dtype, fp8_cache: bool = False
) -> MLATiles:
    """Default tiles. Decode: one token x up to 64 heads (a Hopper warpgroup MMA is 64 rows);
    with fewer heads, queries of the same request fill the 64 rows. float32 tiles are small:
    its tiles are twice the bytes and its dots run on CUDA cores (tests only). An fp8 cache's
    16-row tiles take 32 keys and swapped products (the dequantized tile lives in registers)."""
    heads = max(16, triton.next_power_of_2(num_heads))
    if dtype == torch.float32:
        block_h = min(heads, 16)
        return MLATiles(block_h, 1 if max_query_len <= 1 else 16 // block_h, 16, 4, 1)
    block_h = min(heads, 64)
    block_q = 1 if max_query_len <= 1 else min(64 // block_h, triton.next_power_of_2(max_query_len))
    if block_h * block_q >= 64:
        # (On an sm90 GPU `plan_mla` picks HOPPER_TILES for decode instead.)
        # 64 rows: two warpgroups, each with half of the [64, 512] float32 accumulator (128
        # registers a thread). Shared memory: the queries (72 KiB) and two stages of 64 keys
        # (2 x 72 KiB), which fits Hopper's 227 KiB (elsewhere pass tiles with block_n 32).
        # On an H100 (H 128, B 64, 8k) 64 keys a tile took 584 us, 32 keys 773 us: the two
        # warpgroups split the keys of the score dot, so each reads all the queries per tile.
        return MLATiles(block_h, block_q, 64, 8, 2, programs_per_sm=1)
    # 16 rows (H 16 at TP 8: 2.67 TB/s on an H100 at B 64, 8k, 89% of its copy bandwidth) use
    # 92 KiB of shared memory, so two programs share an SM; 32 rows use 180 KiB. Over an fp8
    # cache (H 16, B 64, 8k on an H100) 64 keys a tile took 344 us, 32 keys 270 us, 32 keys
    # with swapped products 226 us (64 keys swapped: 280 us).
    rows16 = block_h * block_q == 16
    swap = fp8_cache and rows16
    return MLATiles(block_h, block_q, 32 if swap else 64, 4, 2,
                    programs_per_sm=2 if rows16 else 1, swap_ab=swap)  # fmt: skip


HOPPER_TILES = MLATiles(64, 1, 64, 8, 2, hopper=True, warp_specialized=True)


@attrs.frozen
class MLAPlan:
    """What one batch's MLA launches need from the host: tiles, split-KV (None: one segment)
    and, when every request has the same number of query tokens, that number (the kernel then
    maps programs to requests without searching)."""

    tiles: MLATiles
    split: SplitPlan | None
    uniform_query_len: int  # 0: ragged


def plan_mla(
    *,
    num_reqs: int,
    num_tokens: int,
    num_heads: int,
    max_query_len: int,
    max_seq_len: int,
    dtype: torch.dtype,
    device: torch.device,
    tiles: MLATiles | None = None,
    num_segments: int | None = None,
    latent_dims: tuple[int, int] | None = None,
    fp8_cache: bool = False,
) -> MLAPlan:
    """Plan a batch of `num_reqs` requests, `num_tokens` query rows, from host values.

    `num_segments`: None chooses split-KV automatically (decode-shaped batches that would leave
    SMs idle); 1 never splits; k > 1 forces k segments (tests, tuning). Under CUDA graphs, plan
    the capture with the largest `max_seq_len` a replay may see (longer contexts stay correct:
    the last segment takes every key past the others, only balance suffers).

    `latent_dims` `(L, R)`: with them a batch of at least `HOPPER_MIN_HEADS` heads in which
    every request has the same 1 to `HOPPER_MAX_QUERY_LEN` query tokens (decode, speculative
    verification) gets the Hopper kernels (`HOPPER_TILES`) on an sm90 GPU when they can serve
    them (with `fp8_cache`, the Hopper kernel that dequantizes an fp8 latent cache).
    """
    if tiles is None:
        uniform_short = (
            0 < max_query_len <= HOPPER_MAX_QUERY_LEN and num_tokens == num_reqs * max_query_len
        )
        hopper = (
            uniform_short
            and num_heads >= HOPPER_MIN_HEADS
            and latent_dims is not None
            and not hopper_reasons(
                device, dtype, *latent_dims, HOPPER_TILES, fp8_cache=fp8_cache
            )
        )
        tiles = HOPPER_TILES if hopper else mla_tiles(num_heads, max_query_len, dtype, fp8_cache)
    uniform = (
        max_query_len
        if 0 < max_query_len <= MAX_UNIFORM_QUERY_LEN and num_tokens == num_reqs * max_query_len
        else 0
    )
    if num_segments is None:
        num_segments = auto_segments(tiles, num_reqs, num_heads, max_query_len, max_seq_len, device)
    if num_segments < 1:
        raise ValueError(f"num_segments must be None or >= 1, got {num_segments}")
    split = None
    if num_segments > 1:
        segment = cdiv(cdiv(max(max_seq_len, 1), num_segments), tiles.block_n) * tiles.block_n
        split = SplitPlan(num_segments, segment)
    return MLAPlan(tiles, split, uniform)


def auto_segments(
    tiles: MLATiles,
    num_reqs: int,
    num_heads: int,
    max_query_len: int,
    max_seq_len: int,
    device: torch.device,
) -> int:
    """The segment count with the least modelled time: waves of programs (rounded up to whole
    waves of `num_multiprocessors * programs_per_sm`) times keys per program, plus per program
    the query load and, when split, the partial output written and merged (in key-equivalents
    of bytes)."""
    if max_query_len > SPLIT_MAX_QUERY_LEN or num_reqs == 0:
        return 1
    programs = num_reqs * cdiv(num_heads, tiles.block_h) * cdiv(max_query_len, tiles.block_q)
    slots = num_multiprocessors(device) * tiles.programs_per_sm
    # A latent key is (L + R) * 2 bytes; a partial row is L * 4 bytes, written then read: about
    # 4 keys' worth per row for L=512, R=64.
    fixed = tiles.block_m
    split_cost = 4 * tiles.block_m

    def cost(s: int) -> int:
        keys = cdiv(cdiv(max_seq_len, s), SEGMENT_ROUND) * SEGMENT_ROUND
        return cdiv(programs * s, slots) * (keys + fixed + (split_cost if s > 1 else 0))

    most = min(MAX_SEGMENTS, max(1, max_seq_len // (2 * SEGMENT_ROUND)))
    return min(range(1, most + 1), key=cost)  # ties: the fewest segments
