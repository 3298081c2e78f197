"""DeepSeek MLA (weight-absorbed) attention over a paged latent cache: the scratch and the
launchers of `kernels/mla_attention.py` and of the Hopper kernels (`mla_sm90.py`).

Host work once per batch: `plan_mla` (mla_plan.py) picks the tiles from the head count and
query length and, for decode-shaped batches whose programs would under-fill the GPU, a split-KV
plan; `MLAScratch` holds the split's float32 partial results and is sized once (`ensure`)
before any launch or graph capture. Device work per layer: `mla_attention` and
`write_latent_cache` validate shapes on the host and launch; neither reads a device value on
the host nor allocates. An fp8 (e4m3) latent cache (its scale a 0-dim float32 device tensor) is
dequantized by the kernels: in registers by the portable one, in shared memory by the Hopper
fp8 kernel.
"""

from __future__ import annotations

import attrs
import torch
import triton

from unified_attn.backends.triton.merge_ops import merge_mla_partials
from unified_attn.backends.triton.mla_plan import MLAPlan
from unified_attn.backends.triton.mla_sm90 import launch_hopper
from unified_attn.backends.triton.ops import SUPPORTED_DTYPES, SplitPlan
from unified_attn.kernels.mla.mla_attention import (
    mla_attention_kernel,
    write_latent_cache_kernel,
)
from unified_attn.tensor_specs.paged import FP8_KV_DTYPE
from unified_attn.utils import cdiv


@attrs.define
class MLAScratch:
    """Persistent float32 split-KV partial results: `acc [rows * segments, L]` and
    `lse [rows * segments]`, with rows = tokens x heads. `ensure` (host, before launches or a
    graph capture) grows them; the launch only checks that they are large enough."""

    acc: torch.Tensor | None = None
    lse: torch.Tensor | None = None

    def ensure(
        self,
        num_tokens: int,
        num_heads: int,
        num_segments: int,
        kv_lora_rank: int,
        device: torch.device,
    ) -> None:
        need = num_tokens * num_heads * num_segments
        if self.fits(need, kv_lora_rank):
            return
        self.acc = torch.empty(need, kv_lora_rank, dtype=torch.float32, device=device)
        self.lse = torch.empty(need, dtype=torch.float32, device=device)

    def fits(self, rows: int, kv_lora_rank: int) -> bool:
        return (
            self.acc is not None
            and self.lse is not None
            and self.lse.numel() >= rows
            and self.acc.shape[1] == kv_lora_rank
        )


def _dtype_error(name: str, tensor: torch.Tensor, expected: object) -> ValueError:
    return ValueError(f"{name}: expected dtype {expected}, found {tensor.dtype}")


def _shape_error(name: str, expected: str, tensor: torch.Tensor) -> ValueError:
    return ValueError(f"{name}: expected shape {expected}, found {tuple(tensor.shape)}")


def _check_index(name: str, tensor: torch.Tensor, dims: int, dtype: torch.dtype) -> None:
    if tensor.dim() != dims:
        raise _shape_error(name, f"a {dims}-d tensor", tensor)
    if tensor.dtype != dtype:
        raise _dtype_error(name, tensor, dtype)
    if tensor.stride(-1) != 1:
        raise ValueError(
            f"{name}: expected a contiguous last dimension, found strides {tensor.stride()}"
        )


def _check_latent_dims(kv_lora_rank: int, rope_dim: int) -> None:
    for name, value in (("kv_lora_rank", kv_lora_rank), ("rope dim (q.shape[-1] - L)", rope_dim)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name}: expected a power of two >= 16, found {value}")


def _check_cache(latent_cache: torch.Tensor, dtype: torch.dtype, dim: int) -> None:
    if latent_cache.dim() != 3 or latent_cache.shape[2] != dim:
        raise _shape_error("latent_cache", f"[num_blocks, block_size, {dim}]", latent_cache)
    if latent_cache.dtype != dtype:
        raise _dtype_error("latent_cache", latent_cache, dtype)
    if latent_cache.stride(2) != 1:
        raise ValueError(
            f"latent_cache: expected a contiguous last dimension, found strides "
            f"{latent_cache.stride()}"
        )


def _check_attention_inputs(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    kv_lora_rank: int,
    kv_scale: torch.Tensor | None,
) -> None:
    if q.dim() != 3:
        raise _shape_error("q", "[num_tokens, num_heads, L + R]", q)
    if q.dtype not in SUPPORTED_DTYPES:
        raise _dtype_error("q", q, f"one of {SUPPORTED_DTYPES}")
    num_tokens, num_heads, dim = q.shape
    _check_latent_dims(kv_lora_rank, dim - kv_lora_rank)
    if q.stride(2) != 1:
        raise ValueError(f"q: expected a contiguous last dimension, found strides {q.stride()}")
    _check_cache(latent_cache, q.dtype if kv_scale is None else FP8_KV_DTYPE, dim)
    if kv_scale is not None and (kv_scale.shape != () or kv_scale.dtype != torch.float32
                                 or kv_scale.device != q.device):  # fmt: skip
        raise ValueError(
            f"kv_scale: expected a 0-dim float32 tensor on {q.device}, found "
            f"{tuple(kv_scale.shape)} {kv_scale.dtype} on {kv_scale.device}"
        )
    if out.shape != (num_tokens, num_heads, kv_lora_rank):
        raise _shape_error("out", f"({num_tokens}, {num_heads}, {kv_lora_rank})", out)
    if out.dtype != q.dtype:
        raise _dtype_error("out", out, q.dtype)
    if out.stride(2) != 1:
        raise ValueError(f"out: expected a contiguous last dimension, found strides {out.stride()}")
    _check_index("seq_lens", seq_lens, 1, torch.int32)
    _check_index("block_table", block_table, 2, torch.int32)
    _check_index("query_start_loc", query_start_loc, 1, torch.int32)
    num_reqs = seq_lens.shape[0]
    if block_table.shape[0] != num_reqs:
        raise _shape_error("block_table", f"[{num_reqs} (len(seq_lens)), max_blocks]", block_table)
    if query_start_loc.shape[0] != num_reqs + 1:
        raise _shape_error(
            "query_start_loc", f"[{num_reqs + 1}] (len(seq_lens) + 1)", query_start_loc
        )
    for name, t in (
        ("latent_cache", latent_cache),
        ("out", out),
        ("seq_lens", seq_lens),
        ("block_table", block_table),
        ("query_start_loc", query_start_loc),
    ):
        if t.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (q's), found {t.device}")


def mla_attention(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    kv_lora_rank: int,
    *,
    plan: MLAPlan,
    scratch: MLAScratch | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weight-absorbed MLA attention of `q [T, H, L + R]` over `latent_cache [num_blocks,
    block_size, L + R]`; writes and returns `out [T, H, L]`. With `kv_scale` (0-dim float32)
    the cache holds float8 e4m3 latents, each standing for its value times `kv_scale`.

    Request i owns rows `[query_start_loc[i], query_start_loc[i + 1])`; its row j sits at
    position `seq_lens[i] - q_len_i + j` and attends causally to cached positions `[0,
    position]`, position p read at `latent_cache[block_table[i, p // block_size], p %
    block_size]`: all L + R dims are the key, the first L the value. A request with seq_len 0
    (padding) gets zeros. `plan` comes from `plan_mla` for this batch; a split plan needs a
    `scratch` already `ensure`d for at least T x H x num_segments rows.
    """
    _check_attention_inputs(
        q, latent_cache, block_table, query_start_loc, seq_lens, out, kv_lora_rank, kv_scale
    )
    num_tokens, num_heads, _ = q.shape
    num_reqs = seq_lens.shape[0]
    tiles, split = plan.tiles, plan.split
    if plan.uniform_query_len and num_tokens != num_reqs * plan.uniform_query_len:
        raise ValueError(
            f"plan: expected {num_reqs} requests x {plan.uniform_query_len} query tokens (the "
            f"plan's uniform_query_len), found {num_tokens} tokens; plan this batch with plan_mla"
        )
    if num_tokens == 0 or num_reqs == 0:
        return out
    num_segments = split.num_segments if split else 1
    part_acc, part_lse = _partials(split, scratch, num_tokens * num_heads, kv_lora_rank, out)
    if split is not None and split.segment % tiles.block_n:
        raise ValueError(
            f"plan.split.segment: expected a multiple of block_n={tiles.block_n}, found "
            f"{split.segment}"
        )
    if tiles.hopper:
        launch_hopper(q, latent_cache, block_table, seq_lens, scale, out, kv_lora_rank, plan,
                      part_acc, part_lse, kv_scale)  # fmt: skip
        return out
    page = latent_cache.shape[1]
    if plan.uniform_query_len:
        q_blocks = num_reqs * cdiv(plan.uniform_query_len, tiles.block_q)
    else:
        q_blocks = num_tokens // tiles.block_q + num_reqs
    grid = (cdiv(num_heads, tiles.block_h), q_blocks, num_segments)
    mla_attention_kernel[grid](
        out, q, latent_cache, block_table, seq_lens, query_start_loc, part_acc, part_lse,
        seq_lens if kv_scale is None else kv_scale,
        scale * 1.4426950408889634, num_reqs, num_heads, split.segment if split else 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), block_table.stride(0),
        KV_LORA_RANK=kv_lora_rank, ROPE_DIM=q.shape[2] - kv_lora_rank, PAGE=page,
        BLOCK_H=tiles.block_h, BLOCK_Q=tiles.block_q, BLOCK_N=tiles.block_n,
        UNIFORM_QUERY_LEN=plan.uniform_query_len, TILE_IN_PAGE=page % tiles.block_n == 0,
        SPLIT=split is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FP8=kv_scale is not None,
        SWAP_AB=tiles.swap_ab,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    if split is not None:
        merge_mla_partials(out, part_acc, part_lse, num_segments)
    return out


def _partials(
    split: SplitPlan | None,
    scratch: MLAScratch | None,
    rows: int,
    kv_lora_rank: int,
    dummy: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scratch buffers a split launch writes (unused placeholders without a split)."""
    if split is None:
        return dummy, dummy
    need = rows * split.num_segments
    if scratch is None or not scratch.fits(need, kv_lora_rank):
        raise ValueError(
            f"scratch: expected an MLAScratch ensured for {rows} rows (tokens x heads) x "
            f"{split.num_segments} segments of {kv_lora_rank} dims, found "
            f"{'None' if scratch is None else 'one too small'}; call scratch.ensure(...) "
            "when planning, before the launch (or a CUDA-graph capture)"
        )
    assert scratch.acc is not None and scratch.lse is not None
    if scratch.acc.device != dummy.device:
        raise ValueError(f"scratch: expected device {dummy.device}, found {scratch.acc.device}")
    return scratch.acc, scratch.lse


def write_latent_cache(
    latent: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write `latent [T, L + R]` (normed c, then roped k_pe; already quantized for an fp8
    cache) into `latent_cache [num_blocks, block_size, L + R]` (latent's dtype) at
    `slot_mapping [T]` int64 (slot = block * block_size + offset; -1 =
    padding, skipped).

    A Triton kernel rather than `index_copy_`: skipping the -1 slots in torch needs a boolean
    mask (a host sync) or a scratch row to dump padding into, and `index_copy_` on a view with a
    block stride larger than a page cannot flatten to rows; the kernel is one program per token
    and reads nothing back on the host.
    """
    if latent.dim() != 2:
        raise _shape_error("latent", "[num_tokens, L + R]", latent)
    if latent.dtype not in (*SUPPORTED_DTYPES, FP8_KV_DTYPE):
        raise _dtype_error("latent", latent, f"one of {(*SUPPORTED_DTYPES, FP8_KV_DTYPE)}")
    if latent.stride(1) != 1:
        raise ValueError(
            f"latent: expected a contiguous last dimension, found strides {latent.stride()}"
        )
    num_tokens, dim = latent.shape
    _check_cache(latent_cache, latent.dtype, dim)
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] < num_tokens:
        raise _shape_error(
            "slot_mapping", f"[>= {num_tokens}] (one slot per latent row)", slot_mapping
        )
    if slot_mapping.dtype != torch.int64:
        raise _dtype_error("slot_mapping", slot_mapping, torch.int64)
    if num_tokens == 0:
        return
    write_latent_cache_kernel[(num_tokens,)](
        latent, latent_cache, slot_mapping,
        latent.stride(0), latent_cache.stride(0), latent_cache.stride(1),
        DIM=dim, DIM_PAD=triton.next_power_of_2(dim), PAGE=latent_cache.shape[1],
    )  # fmt: skip
