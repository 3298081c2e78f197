"""The Hopper (sm90) MLA decode kernels: which batches they serve, and their launches.

Three Gluon kernels serve weight-absorbed MLA decode (one query token per request, or up to
`HOPPER_MAX_QUERY_LEN` of them in speculative verification; at least 32 heads, padded to 64 per
program) on an sm90 GPU with 16-bit queries:
- the warp-specialized kernel (`kernels/mla_decode_sm90_ws.py`), when every page holds a
  multiple of 64 keys (a tile is one page's rows, one TMA copy) and its shared memory fits;
- the lockstep kernel (`kernels/mla_attention_sm90.py`) otherwise (any page size);
- the fp8 kernel (`kernels/mla_decode_sm90_fp8.py`) for an fp8 (e4m3) latent cache, which it
  dequantizes into shared memory while the tensor cores work (any page size).
`plan_mla` (mla_plan.py) picks them; `launch_hopper` chooses among the three from the cache's
layout at launch (host values only: no device read, CUDA-graph safe).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from unified_attn.backends.triton.merge_ops import merge_mla_partials
from unified_attn.backends.triton.ops import SM90_SHARED_BYTES, is_sm90, rows_16_byte_aligned
from unified_attn.kernels.mla.mla_attention_sm90 import mla_attention_sm90_kernel
from unified_attn.kernels.mla.mla_decode_sm90_fp8 import mla_decode_sm90_fp8_kernel
from unified_attn.kernels.mla.mla_decode_sm90_ws import mla_decode_sm90_ws_kernel
from unified_attn.utils import cdiv

if TYPE_CHECKING:
    from unified_attn.backends.triton.mla_plan import MLAPlan, MLATiles

HOPPER_LATENT_RANKS = (128, 256, 512)  # L: each warpgroup's output half is one wgmma (N <= 256)
HOPPER_ROPE_DIMS = (16, 32, 64, 128)
HOPPER_MAX_QUERY_LEN = 8  # query tokens per request: decode and speculative verification
WS_TILE = 64  # keys per tile of the warp-specialized kernel
LOG2E = 1.4426950408889634


def hopper_reasons(
    device: torch.device,
    dtype: torch.dtype,
    kv_lora_rank: int,
    rope_dim: int,
    tiles: MLATiles,
    *,
    fp8_cache: bool = False,
) -> list[str]:
    """Why the lockstep Hopper kernel with `tiles` (the fp8 kernel with `fp8_cache`) cannot
    serve these latent dims on this device (none: it can; the warp-specialized one serves a
    subset of what the lockstep one serves)."""
    reasons = []
    if not is_sm90(device):
        reasons.append(f"device {device} is not an sm90 GPU")
    if dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"dtype {dtype} is not 16-bit")
    if kv_lora_rank not in HOPPER_LATENT_RANKS:
        reasons.append(f"kv_lora_rank {kv_lora_rank} is not one of {HOPPER_LATENT_RANKS}")
    if rope_dim not in HOPPER_ROPE_DIMS:
        reasons.append(f"rope dim {rope_dim} is not one of {HOPPER_ROPE_DIMS}")
    elif shared_bytes(kv_lora_rank, rope_dim, tiles, fp8_cache) + 1024 > SM90_SHARED_BYTES:
        need = shared_bytes(kv_lora_rank, rope_dim, tiles, fp8_cache)
        reasons.append(
            f"L + R = {kv_lora_rank + rope_dim} with {tiles.num_stages} stages of "
            f"{tiles.block_n} {'fp8 ' if fp8_cache else ''}keys needs {need} bytes of "
            f"shared memory (plus about 1 KiB of scratch), more than the {SM90_SHARED_BYTES} "
            "an sm90 program has"
        )
    return reasons


def shared_bytes(kv_lora_rank: int, rope_dim: int, tiles: MLATiles, fp8_cache: bool) -> int:
    """Shared memory of one lockstep program (`MLATiles.shared_bytes`) or, with `fp8_cache`,
    of one fp8 program (which takes no stages): the float16 query, two dequantized tiles and
    the probabilities."""
    if not fp8_cache:
        return tiles.shared_bytes(kv_lora_rank, rope_dim)
    dim, tile = kv_lora_rank + rope_dim, tiles.block_n
    return 2 * (64 * dim + 2 * tile * dim + 64 * tile)


def ws_shared_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    """Shared memory of one warp-specialized program (2-byte data): the query, two stages of
    both latent halves and of the rope features, both stages' probabilities, the statistics."""
    data = 64 * kv_lora_rank + 2 * WS_TILE * (kv_lora_rank + rope_dim) + 2 * 64 * WS_TILE
    return 2 * data + 4 * (4 * 64 + 2 * 64) + 8 * 8


def warp_specialized_fits(cache: torch.Tensor, kv_lora_rank: int, tiles: MLATiles) -> bool:
    """The warp-specialized kernel serves this cache: pages of a multiple of 64 keys, rows and
    blocks TMA can address (16-byte aligned, a block a whole number of rows apart) and its
    shared memory within an sm90 program's."""
    rope_dim = cache.shape[2] - kv_lora_rank
    row, block = cache.stride(1), cache.stride(0)
    return (
        tiles.warp_specialized
        and tiles.block_n == WS_TILE
        and cache.shape[1] % WS_TILE == 0
        and (row * cache.element_size()) % 16 == 0
        and block % row == 0
        and cache.data_ptr() % 16 == 0
        and ws_shared_bytes(kv_lora_rank, rope_dim) + 1024 <= SM90_SHARED_BYTES
    )


@functools.lru_cache(maxsize=64)
def _descriptors(cache: torch.Tensor, kv_lora_rank: int) -> tuple[TensorDescriptor, ...]:
    """TMA descriptors over the cache's rows: its latent part as [rows, L] in blocks of
    [64, L / 2] and its rope part as [rows, R] in blocks of [64, R]; row `block *
    (block stride / row stride) + slot`. Kept per cache tensor (a bound cache view never
    changes; building them took 54 µs a launch on the host, every layer of every eager step):
    the cache holds the tensor, so its id is not reused while cached."""
    gl_dtype = gl.bfloat16 if cache.dtype == torch.bfloat16 else gl.float16
    rope_dim = cache.shape[2] - kv_lora_rank
    row = cache.stride(1)
    rows = (cache.shape[0] - 1) * (cache.stride(0) // row) + cache.shape[1]
    offset = cache.storage_offset()
    latent = cache.as_strided((rows, kv_lora_rank), (row, 1), offset)
    rope = cache.as_strided((rows, rope_dim), (row, 1), offset + kv_lora_rank)
    blocks = ([WS_TILE, kv_lora_rank // 2], [WS_TILE, rope_dim])
    layouts = [gl.NVMMASharedLayout.get_default_for(b, gl_dtype) for b in blocks]
    return (
        TensorDescriptor.from_tensor(latent, blocks[0], layouts[0]),
        TensorDescriptor.from_tensor(rope, blocks[1], layouts[1]),
    )


def launch_hopper(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    kv_lora_rank: int,
    plan: MLAPlan,
    part_acc: torch.Tensor,
    part_lse: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """A Hopper kernel (the fp8 one with `kv_scale`, else the warp-specialized one where
    `warp_specialized_fits`), then the merge of a split's partials. Each query token is its
    own program row: with `uniform_query_len` n > 1 (speculative verification) token j of a
    request sees its first `seq_len - n + j + 1` keys. Raises ValueError naming what does not
    fit."""
    num_tokens, num_heads, dim = q.shape
    tiles, split = plan.tiles, plan.split
    fp8 = kv_scale is not None
    reasons = hopper_reasons(q.device, q.dtype, kv_lora_rank, dim - kv_lora_rank, tiles,
                             fp8_cache=fp8)  # fmt: skip
    if not 1 <= plan.uniform_query_len <= HOPPER_MAX_QUERY_LEN:
        reasons.append(
            f"the plan's uniform_query_len is {plan.uniform_query_len}, not 1 to "
            f"{HOPPER_MAX_QUERY_LEN} (decode or speculative verification)"
        )
    if not rows_16_byte_aligned(q, out, latent_cache):
        strides = (q.stride()[:2], out.stride()[:2], latent_cache.stride()[:2])
        reasons.append(f"rows of q, out or the cache are not 16-byte aligned (strides {strides})")
    if reasons:
        raise ValueError(
            f"plan.tiles: the Hopper MLA kernel cannot run this batch: {'; '.join(reasons)}; "
            "plan it with plan_mla without tiles (or pass portable MLATiles)"
        )
    num_segments = split.num_segments if split else 1
    grid = (cdiv(num_heads, 64), num_segments, num_tokens)
    segment = split.segment if split else 0
    rope_dim = dim - kv_lora_rank
    if fp8:
        mla_decode_sm90_fp8_kernel[grid](
            out, q, latent_cache, block_table, seq_lens, part_acc, part_lse, kv_scale, scale,
            num_heads, segment, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            latent_cache.stride(0), latent_cache.stride(1), block_table.stride(0),
            L=kv_lora_rank, R=rope_dim, PAGE=latent_cache.shape[1], TILE=tiles.block_n,
            SPLIT=split is not None, QUERY_LEN=plan.uniform_query_len, num_warps=8,
        )  # fmt: skip
    elif warp_specialized_fits(latent_cache, kv_lora_rank, tiles):
        desc, rope_desc = _descriptors(latent_cache, kv_lora_rank)
        mla_decode_sm90_ws_kernel[grid](
            out, q, block_table, seq_lens, part_acc, part_lse, scale * LOG2E, num_heads, segment,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
            latent_cache.stride(0) // latent_cache.stride(1), 0, desc, rope_desc,
            L=kv_lora_rank, R=rope_dim, PAGE=latent_cache.shape[1], SPLIT=split is not None,
            QUERY_LEN=plan.uniform_query_len, num_warps=4,
        )  # fmt: skip
    else:
        mla_attention_sm90_kernel[grid](
            out, q, latent_cache, block_table, seq_lens, part_acc, part_lse, scale, num_heads,
            segment, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            latent_cache.stride(0), latent_cache.stride(1), block_table.stride(0),
            L=kv_lora_rank, R=rope_dim, PAGE=latent_cache.shape[1], TILE=tiles.block_n,
            STAGES=tiles.num_stages, SPLIT=split is not None, QUERY_LEN=plan.uniform_query_len,
            num_warps=8,
        )  # fmt: skip
    if split is not None:
        merge_mla_partials(out, part_acc, part_lse, num_segments)
