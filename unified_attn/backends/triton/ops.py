"""Launchers: validate inputs, choose tiles and grid, launch the kernels in `kernels/`."""

from __future__ import annotations

import functools
import os

import attrs
import torch
import triton

from unified_attn.kernels.attention.cache_write import write_kv_cache_kernel
from unified_attn.kernels.attention.merge_segments import merge_segments_kernel
from unified_attn.kernels.attention.unified_attention import unified_attention_kernel
from unified_attn.kernels.launch import FastLaunch
from unified_attn.kernels.pdl import pdl_enabled
from unified_attn.utils import cdiv

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# decode steps run these per layer: past Triton's Python dispatch once compiled (kernels/launch.py)
_ATTENTION = FastLaunch(unified_attention_kernel)
_MERGE = FastLaunch(merge_segments_kernel)
_WRITE_KV = FastLaunch(write_kv_cache_kernel)
FP8_KV_DTYPE = torch.float8_e4m3fn  # the cache dtype the kernels dequantize with per-layer scales


@attrs.frozen
class SplitPlan:
    """Split-KV: `num_segments` programs per (query block, KV head), `segment` keys each."""

    num_segments: int
    segment: int


MAX_SEGMENTS = 32
SPLIT_MIN_SEQ_LEN = 1024  # shorter decode batches are never worth the merge launch
SEGMENT_ROUND = 128  # segment lengths are whole decode tiles


def _num_segments(programs: int, target: int) -> int:
    """Segments per (request, KV head) that bring `programs` to about `target` (a power of
    two, at most `MAX_SEGMENTS`); 1 when they already fill it."""
    if programs >= target:
        return 1
    return min(MAX_SEGMENTS, triton.next_power_of_2(cdiv(target, programs)))


def plan_split(
    *, max_query_len: int, max_seq_len: int, num_reqs: int, num_kv_heads: int, device: torch.device
) -> SplitPlan | None:
    """Split-KV for decode batches (one query token per request) whose `num_reqs *
    num_kv_heads` programs would under-fill the GPU: enough segments (a power of two, at most
    `MAX_SEGMENTS`) for two programs per SM, each a whole number of 128-key tiles (H100 sweep,
    `benchmarks/kernel_targets.py --sweep`: batch 1 at 32k runs 2.2 TB/s with 32 segments of
    1024 keys, 1.6 with 16 of 64-key tiles)."""
    if max_query_len != 1 or max_seq_len < SPLIT_MIN_SEQ_LEN:
        return None
    segments = _num_segments(num_reqs * num_kv_heads, 2 * num_multiprocessors(device))
    if segments == 1:
        return None
    return SplitPlan(segments, cdiv(cdiv(max_seq_len, segments), SEGMENT_ROUND) * SEGMENT_ROUND)


def max_split_rows(num_q_heads: int, num_kv_heads: int, device: torch.device) -> int:
    """The most split-KV scratch rows (token x query head x segment) any plan of
    `plan_split` asks for: only batches of fewer than `2 * SMs / num_kv_heads` decode
    requests split, into fewer segments the more requests there are."""
    target = 2 * num_multiprocessors(device)
    return max(
        reqs * num_q_heads * _num_segments(reqs * num_kv_heads, target)
        for reqs in range(1, cdiv(target, num_kv_heads) + 1)
    )


def interpreter_on() -> bool:
    """True when Triton runs its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def platform_reasons(device: str, dtype: torch.dtype) -> list[str]:
    """Why the Triton kernels cannot run on `device` in `dtype` (empty: they can): a CUDA device,
    or the CPU under the interpreter; float16, bfloat16 or float32."""
    reasons = []
    kind = torch.device(device).type
    if kind != "cuda" and not (kind == "cpu" and interpreter_on()):
        reasons.append(f"needs a CUDA device (or TRITON_INTERPRET=1 on CPU), got {kind}")
    if dtype not in SUPPORTED_DTYPES:
        reasons.append(f"dtype {dtype} is not one of {SUPPORTED_DTYPES}")
    return reasons


SM90_SHARED_BYTES = 232448  # shared memory one sm90 (Hopper) program may use: 227 KiB


@functools.cache
def is_sm90(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def rows_16_byte_aligned(*tensors: torch.Tensor) -> bool:
    """Every tensor starts on a 16-byte boundary and its first two dims step in whole 16-byte
    units (2-byte data: multiples of 8 elements), as 16-byte copies and TMA need."""
    return all(
        t.data_ptr() % 16 == 0 and all((x * t.element_size()) % 16 == 0 for x in t.stride()[:2])
        for t in tensors
    )


@functools.cache
def num_multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: any small number exercises the split path
    return torch.cuda.get_device_properties(device).multi_processor_count


@attrs.frozen
class TileConfig:
    block_m: int  # query rows per program: BLOCK_Q tokens x QPK heads
    tile: int  # keys per loop iteration
    num_warps: int
    num_stages: int
    max_registers: int | None = None  # per thread (Triton's `maxnreg`): more programs per SM


def tile_config(
    qpk: int,
    head_size: int,
    max_query_len: int,
    dtype: torch.dtype,
    fp8: bool = False,
    block_size: int = 16,
    batch_invariant: bool = False,
    split: bool = False,
) -> TileConfig:
    """Tiles measured on an H100 (bf16, 32q/8kv/d128): decode by `benchmarks/tune_decode.py`
    and `benchmarks/kernel_targets.py --sweep`, prefill by `tune_prefill.py` (8k, 16k and 32k
    tokens; `results/tune_*_h100.json`). The block table is read one tile ahead, so K/V tiles
    are multi-buffered from 3 stages on.

    * Decode packs the query heads of a KV head into the fewest rows (16).
      - fp8 caches: 64 keys in 3 stages with at most 128 registers per thread, four programs
        per SM (batch 64 / 32k: 2.83 TB/s of fp8 bytes against 2.69 for 128 keys at 255
        registers; capping the 128-key tile spills and loses).
      - Split-KV launches (small batches): 128 keys in 2 stages (batch 32 / 8k: 2.85 TB/s
        against 2.74 for 128 keys in 3 stages, which multi-buffer).
      - Unsplit bf16 batches: 64 keys in 2 stages (batch 64 / 32k: 3.04 TB/s).
    * Prefill: pages of 64+ tokens take 128 x 64 with 8 warps and 3 stages, one page per key
      tile (421 / 456 / 446 TFLOP/s at 8k / 16k / 32k, 1.25-1.32x SDPA flash); 16-token pages
      128 x 128 (388 at 8k).
    * float32 and heads over 128 keep smaller tiles: those would not fit shared memory.
    * Batch-invariant mode keeps the 64 x 32 tile it was measured with for every row: its
      tiles depend on the layer only, never on the batch."""
    heads = triton.next_power_of_2(qpk)
    small_elements = fp8 or dtype.itemsize <= 2
    if batch_invariant or (max_query_len > 1 and (head_size > 128 or not small_elements)):
        return TileConfig(max(64 if head_size <= 128 else 32, heads), 32, 4, 2)
    if max_query_len <= 1:
        rows = max(16, heads)
        if head_size <= 128 and fp8:
            return TileConfig(rows, 64, 4, 3, max_registers=128 if rows == 16 else None)
        if head_size <= 128 and split and small_elements:
            return TileConfig(rows, 128, 4, 2)
        return TileConfig(rows, 64 if head_size <= 128 else 32, 4, 2)
    if block_size % 64 == 0:
        return TileConfig(max(128, heads), 64, 8, 3)
    return TileConfig(max(128, heads), 128, 8, 3)


def _check_cache(name: str, cache: torch.Tensor, num_kv_heads: int, head_size: int) -> None:
    if cache.dim() != 4 or cache.shape[2:] != (num_kv_heads, head_size):
        raise ValueError(
            f"{name} must be [num_blocks, block_size, {num_kv_heads}, {head_size}], got "
            f"{tuple(cache.shape)}"
        )


def _check_kv_scales(
    k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales: torch.Tensor | None
) -> bool:
    """True for fp8 caches, whose `kv_scales` must be `[2]` float32 on their device."""
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    if k_cache.dtype != FP8_KV_DTYPE:
        return False
    if (
        kv_scales is None
        or kv_scales.shape != (2,)
        or kv_scales.dtype != torch.float32
        or kv_scales.device != k_cache.device
    ):
        found = None if kv_scales is None else (kv_scales.dtype, tuple(kv_scales.shape))
        raise ValueError(
            f"fp8 caches need kv_scales, a [2] float32 tensor (k_scale, v_scale) on "
            f"{k_cache.device}; got {found}"
        )
    return True


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """`key`/`value [T, Hkv, D]` into the caches at `slot_mapping [T]` (-1 skipped). fp8
    caches: quantized with saturation, `e4m3(clamp(x / scale, -448, 448))`, with `kv_scales
    [2]` (k_scale, v_scale), bitwise as `kv_quant.quantize_fp8`."""
    num_tokens, num_kv_heads, head_size = key.shape
    _check_cache("k_cache", k_cache, num_kv_heads, head_size)
    _check_cache("v_cache", v_cache, num_kv_heads, head_size)
    fp8 = _check_kv_scales(k_cache, v_cache, kv_scales)
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value must be contiguous in the head dimension")
    if slot_mapping.shape[0] < num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {num_tokens} tokens")
    if num_tokens == 0:
        return
    _WRITE_KV[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, kv_scales if fp8 else slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_SIZE=head_size,
        HEAD_PAD=triton.next_power_of_2(head_size),
        BLOCK_SIZE=k_cache.shape[1],
        FP8_KV=fp8,
        launch_pdl=pdl_enabled(key.device),
    )  # fmt: skip


@attrs.define
class SplitScratch:
    """Persistent float32 buffers for split-KV partial results, grown on demand."""

    acc: torch.Tensor | None = None
    max: torch.Tensor | None = None
    sum: torch.Tensor | None = None

    def ensure(
        self, rows: int, segments: int, head_pad: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three buffers, reallocated only when too small (captured graphs keep them)."""
        need = rows * segments
        if (
            self.acc is None
            or self.max is None
            or self.sum is None
            or self.max.numel() < need
            or self.acc.shape[1] != head_pad
        ):
            self.acc = torch.empty(need, head_pad, dtype=torch.float32, device=device)
            self.max = torch.empty(need, dtype=torch.float32, device=device)
            self.sum = torch.empty(need, dtype=torch.float32, device=device)
        return self.acc, self.max, self.sum


def unified_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    num_seqs: int,
    max_query_len: int,
    scale: float,
    causal: bool = True,
    window: int | None = None,
    chunk: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sink_tokens: int = 0,
    split: SplitPlan | None = None,
    scratch: SplitScratch | None = None,
    batch_invariant: bool = False,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged attention of `q [T, Hq, D]` over the caches; writes `out [T, Hq, D]`.

    Sequence i owns query tokens `[query_start_loc[i], query_start_loc[i + 1])`, and its keys
    are positions `[0, seq_lens[i])` mapped through `block_table[i]`. Causal queries are the
    sequence's last positions; non-causal ones (encoder, cross-attention) are numbered from 0
    and may outnumber the keys (cross-attention: every query sees every key). With
    `batch_invariant` the tiles never depend on the batch (no split, the prefill tile shape
    for every row), so a request's output is bitwise the same in any batch. fp8 (e4m3)
    caches are dequantized in registers with `kv_scales [2]` float32 (k_scale, v_scale): the
    result is attention over `stored * scale` in the query dtype.
    """
    num_tokens, num_q_heads, head_size = q.shape
    num_kv_heads = k_cache.shape[2]
    _check_cache("k_cache", k_cache, num_kv_heads, head_size)
    _check_cache("v_cache", v_cache, num_kv_heads, head_size)
    fp8 = _check_kv_scales(k_cache, v_cache, kv_scales)
    cache_ok = fp8 or k_cache.dtype == q.dtype
    if q.dtype not in SUPPORTED_DTYPES or out.dtype != q.dtype or not cache_ok:
        raise ValueError(
            f"q, caches and out must share one dtype of {SUPPORTED_DTYPES} (caches may be "
            f"{FP8_KV_DTYPE} with kv_scales), got {q.dtype}, {k_cache.dtype}, {out.dtype}"
        )
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if q.stride(-1) != 1 or out.stride(-1) != 1 or out.shape != q.shape:
        raise ValueError("q and out must have the same shape and a contiguous head dimension")
    if num_tokens == 0 or num_seqs == 0:
        return out
    qpk = num_q_heads // num_kv_heads
    if batch_invariant and split is not None:
        raise ValueError("batch-invariant attention cannot split the KV loop by batch shape")
    cfg = tile_config(
        qpk, head_size, max_query_len, q.dtype, fp8, k_cache.shape[1], batch_invariant,
        split is not None and split.num_segments > 1,
    )
    head_pad = max(16, triton.next_power_of_2(head_size))
    block_m = max(cfg.block_m, triton.next_power_of_2(qpk))
    block_q = block_m // qpk
    num_segments, segment = (split.num_segments, split.segment) if split else (1, cfg.tile)
    dummy = out
    seg_acc = seg_max = seg_sum = dummy
    # The K and V views of one page share strides and storage: V's addresses are K's + a constant.
    shared_offsets = (
        k_cache.stride() == v_cache.stride()
        and k_cache.untyped_storage().data_ptr() == v_cache.untyped_storage().data_ptr()
    )
    v_minus_k = (
        (v_cache.data_ptr() - k_cache.data_ptr()) // k_cache.element_size() if shared_offsets else 0
    )
    if num_segments > 1:
        if scratch is None:
            raise ValueError("split-KV needs a SplitScratch")
        seg_acc, seg_max, seg_sum = scratch.ensure(
            num_tokens * num_q_heads, num_segments, head_pad, q.device
        )
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_segments)
    pdl = pdl_enabled(q.device)  # kernels/pdl.py: each kernel may launch during the one before
    _ATTENTION[grid](
        out, q, k_cache, v_cache, block_table, seq_lens, query_start_loc,
        sinks if sinks is not None else dummy,
        alibi_slopes if alibi_slopes is not None else dummy,
        kv_scales if fp8 else dummy,
        seg_acc, seg_max, seg_sum,
        scale, soft_cap or 0.0, num_seqs, num_q_heads, segment, v_minus_k,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride(), *v_cache.stride(), block_table.stride(0),
        QPK=qpk, BLOCK_SIZE=k_cache.shape[1], HEAD_SIZE=head_size, HEAD_PAD=head_pad,
        BLOCK_M=block_m, BLOCK_Q=block_q, TILE=cfg.tile,
        CAUSAL=causal, WINDOW=window or 0, CHUNK=chunk or 0, SINK_TOKENS=sink_tokens,
        USE_SINKS=sinks is not None, USE_ALIBI=alibi_slopes is not None,
        USE_SOFTCAP=bool(soft_cap), NUM_SEGMENTS=num_segments,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SHARED_KV_OFFSETS=shared_offsets, FP8_KV=fp8, SPLIT_MASKING=not batch_invariant,
        TABLE_AHEAD=cfg.num_stages >= 3,  # with 2 stages K/V are single-buffered either way
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.max_registers,
        launch_pdl=pdl,
    )  # fmt: skip
    if num_segments > 1:
        _MERGE[(num_tokens, num_q_heads)](
            out, seg_acc, seg_max, seg_sum,
            sinks if sinks is not None else dummy,
            num_q_heads, out.stride(0), out.stride(1),
            HEAD_SIZE=head_size, HEAD_PAD=head_pad, NUM_SEGMENTS=num_segments,
            USE_SINKS=sinks is not None, launch_pdl=pdl,
        )  # fmt: skip
    return out
